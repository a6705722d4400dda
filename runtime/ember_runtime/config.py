"""The runtime configuration: the one contract between the operator and the node-side code.

The operator renders this model as YAML into the ConfigMap mounted at `/etc/ember/config.yaml`;
the prewarm init container and the runtime sidecar read it back with `load_config`. Field names
are camelCase on the wire (like every Kubernetes object) and snake_case in Python.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ember_runtime.memory import unified_kv

log = logging.getLogger(__name__)
DEFAULT_CONFIG_PATH = Path("/etc/ember/config.yaml")
CONFIG_ENV = "EMBER_CONFIG"


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelFile(_Wire):
    path: str = Field(description="Path relative to the model directory.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)


class EngineSettings(_Wire):
    kind: Literal["llamacpp", "tensorrt-llm"] = "llamacpp"
    context_length: int = Field(default=2048, ge=64)
    max_batch_size: int = Field(default=16, ge=1, le=256)
    min_batch_size: int = Field(default=4, ge=1, le=256)
    threads: int = Field(default=1, ge=1)
    deterministic: bool = Field(
        default=False,
        description="Batch-independent greedy output at a throughput cost (engines/llamacpp).",
    )
    step_tokens: int = Field(
        default=256,
        ge=16,
        le=4096,
        description="Prompt tokens per scheduling step beside the decodes (engines/scheduler).",
    )
    kv_unified: bool | None = Field(
        default=None,
        description="One KV pool for all sequences (None: the mode's default; never when "
        "deterministic).",
    )
    args: dict[str, str] = Field(default_factory=dict)

    def llamacpp_modes(self) -> LlamaCppModes:
        """`deterministic`, plus the deprecated `args` flags of the previous release.

        `exactBatching`, `prefixCache` and `repack` were free-form strings; they still work for
        this release (an explicit flag wins over what `deterministic` implies) and each one
        logs a deprecation warning naming its replacement.
        """
        deterministic = self.deterministic
        exact = _legacy_flag(self.args, "exactBatching", "engine.deterministic")
        if exact is not None:
            deterministic = deterministic or exact
        return LlamaCppModes(
            deterministic=deterministic,
            prefix_cache=_legacy_flag(self.args, "prefixCache", "engine.deterministic"),
            repack=_legacy_flag(self.args, "repack", "engine.deterministic"),
            kv_unified=unified_kv(deterministic, self.kv_unified),
        )


@dataclass(frozen=True)
class LlamaCppModes:
    deterministic: bool
    prefix_cache: bool | None  # None: what the mode implies (on unless deterministic)
    repack: bool | None
    kv_unified: bool


def _legacy_flag(args: dict[str, str], key: str, replacement: str) -> bool | None:
    raw = args.get(key)
    if raw is None:
        return None
    log.warning(
        "engine.args.%s is deprecated and will be removed in the next release; use %s "
        "(fast batching, repacking and the prefix cache are the default now)",
        key,
        replacement,
    )
    return raw.strip().lower() == "true"


class ServerSettings(_Wire):
    host: str = "0.0.0.0"  # noqa: S104 - a pod's server must listen on the pod IP
    port: int = Field(default=8080, ge=1, le=65535)
    api_key_file: str | None = Field(
        default=None, description="File holding the API key (mounted from apiKeySecretRef)."
    )
    max_queue: int = Field(default=64, ge=1, description="Admission queue bound; beyond it 429.")
    request_timeout_seconds: float = Field(default=300.0, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)


class SensorSettings(_Wire):
    sysfs_root: str = "/sys"
    nvml: bool = False
    npu_smi: str | None = None
    interval_seconds: float = Field(default=1.0, gt=0)
    zone_types: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of thermal-zone types that count (empty: all zones).",
    )
    ewma_rising: float = Field(
        default=1.0, gt=0, le=1, description="EWMA weight of a rising reading (fast attack)."
    )
    ewma_falling: float = Field(
        default=0.5, gt=0, le=1, description="EWMA weight of a falling reading (slow release)."
    )


class RuntimeConfig(_Wire):
    model_name: str
    format: Literal["gguf", "trtllm-engine"] = "gguf"
    model_dir: str = Field(description="Where the model's files are mounted (the source).")
    files: list[ModelFile] = Field(default_factory=list)
    prewarm_dir: str | None = Field(
        default=None, description="Memory-backed directory that prewarm fills; None: no prewarm."
    )
    accelerator: Literal["cpu", "nvidia-gpu", "npu"] = "cpu"
    engine: EngineSettings = Field(default_factory=EngineSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    sensors: SensorSettings = Field(default_factory=SensorSettings)
    termination_log: str = "/dev/termination-log"

    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


def load_config(path: str | Path | None = None) -> RuntimeConfig:
    """Read the config from `path`, else `$EMBER_CONFIG`, else the ConfigMap mount."""
    chosen = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    data = yaml.safe_load(chosen.read_text())
    return RuntimeConfig.model_validate(data)
