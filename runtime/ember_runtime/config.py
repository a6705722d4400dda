"""The one contract between the operator and the node-side code.

- `RuntimeConfig`: the operator renders it as YAML into the ConfigMap mounted at
  `/etc/ember/config.yaml`; the prewarm init container and the runtime sidecar read it back with
  `load_config`. Field names are camelCase on the wire (like every Kubernetes object) and
  snake_case in Python.
- `ThermalPolicy` (its `thermal:` section) and the policy itself (temperature → batch limit):
  the runtime applies it at every sensor sample; the operator only renders it. It is left out of
  the pod template's config hash, so changing it reloads the runtimes instead of restarting them.
- The `ember.dev/Thermal` condition the runtime writes on its own Pod (`thermal_condition`) and
  the node agent on its Node, and its parser (`parse_thermal_message`) the operator reads it with.

The operator imports this module; the runtime never imports the operator.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from ember_runtime.memory import DEFAULT_STEP_TOKENS, offloaded_layers, unified_kv

# libyaml's emitter when PyYAML has it (its wheels do). Its output is the pure-Python
# SafeDumper's, byte for byte, for the plain data dumped here (tests/operator/test_render.py
# compares them), so digests and the pod template's hash do not move; it is 5x faster, and
# the operator dumps four documents per InferenceDeployment it renders.
_YAML_DUMPER = yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper


def dump_yaml(data: Any, *, sort_keys: bool) -> str:
    """`yaml.safe_dump`, through libyaml where available."""
    return str(yaml.dump(data, Dumper=_YAML_DUMPER, sort_keys=sort_keys))


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


# What the node agent fetches comes from an InferenceDeployment's own spec (validated by its
# CRD), never from anything a pod author writes: the pod names its InferenceDeployment with
# INSTANCE_LABEL, and the agent reads that object in the pod's own namespace (nodeagent/fetcher).
# A pod can so name only a spec of its own namespace, whose author could run it anyway.
INSTANCE_LABEL = "ember.dev/instance"
# On a pod whose model comes from an http source: a digest of its fetch list (`fetch_hash`). It
# says "read my InferenceDeployment's spec" (pods without it cost the agent nothing) and,
# being in the pod template, rolls the pods when a URL changes. Its value is never trusted.
FETCH_HASH_ANNOTATION = "ember.dev/model-fetch-hash"
# A replica of an http source mounts, per digest of its files, `<cache>/views/<digest>`: the node
# agent's view holding that one file (`data`, a hard link to the verified blob), its download's
# `data.partial`, and `failed`/`waiting` lines; never the cache itself (nodeagent/views.py).
VIEWS_DIR = "views"
# The node agent's live report of a waiting replica's download, on its pod (nodeagent/podprogress).
MODEL_DOWNLOAD_CONDITION = "ember.dev/ModelDownload"
VIEW_DATA = "data"
# On a Node whose agent holds a file in its cache: `cache.ember.dev/<first 16 hex of the
# sha256>: "true"` (a sha256 does not fit a label name; 64 bits tell a fleet's models apart).
# The agent sets and removes it; the operator prefers nodes that carry it (nodeAffinity).
CACHE_LABEL_PREFIX = "cache.ember.dev/"
CACHE_LABEL_DIGEST = 16


def cache_label(sha256: str) -> str:
    return f"{CACHE_LABEL_PREFIX}{sha256[:CACHE_LABEL_DIGEST]}"


class FetchFile(_Wire):
    url: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=1)


class ModelFetch(_Wire):
    secret_ref: str | None = Field(
        default=None, description="Secret in the node agent's namespace with credentials."
    )
    files: list[FetchFile]

    def digest(self) -> str:
        """`FETCH_HASH_ANNOTATION`'s value: changes with any URL, digest, size or Secret."""
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def fetch_from_spec(model: Any) -> ModelFetch | None:
    """An InferenceDeployment's `spec.model` (as the API server returns it) → what to fetch;
    None for a source other than http. Raises ValueError (pydantic's) on a shape the CRD
    would not have accepted."""
    if not isinstance(model, dict):
        raise ValueError("spec.model is not an object")
    http = (model.get("source") or {}).get("http")
    if http is None:
        return None
    urls = http.get("urls") or {}
    secret = http.get("secretRef") or {}
    files = [
        {"url": urls[f["path"]], "sha256": f.get("sha256"), "sizeBytes": f.get("sizeBytes")}
        for f in model.get("files") or []
        if f.get("path") in urls
    ]
    return ModelFetch.model_validate({"secretRef": secret.get("name"), "files": files})


class EngineSettings(_Wire):
    kind: Literal["llamacpp", "tensorrt-llm"] = "llamacpp"
    context_length: int = Field(default=2048, ge=64)
    max_batch_size: int = Field(
        default=16, ge=1, le=256, description="Capacity: sequences the engine allocates for."
    )
    threads: int = Field(default=1, ge=1)
    deterministic: bool = Field(
        default=False,
        description="Batch-independent greedy output at a throughput cost (engines/llamacpp).",
    )
    step_tokens: int = Field(
        default=DEFAULT_STEP_TOKENS,
        ge=16,
        le=4096,
        description="Prompt tokens per scheduling step beside the decodes (engines/scheduler).",
    )
    kv_unified: bool | None = Field(
        default=None,
        description="One KV pool for all sequences (None: the mode's default; never when "
        "deterministic).",
    )
    gpu_layers: int | None = Field(
        default=None,
        ge=0,
        description="llamacpp: layers offloaded to the GPU (None: every layer on nvidia-gpu, "
        "none elsewhere; 0 keeps the model on the CPU).",
    )
    sampler_threads: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="llamacpp: threads that draw a step's rows in parallel (None: the cores "
        "`threads` leaves spare, up to 8, and none when fewer than 2 are; 0: none).",
    )
    device_sampling: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="llamacpp: sample eligible requests inside llama_decode on the device "
        "(auto: when layers are offloaded to a GPU; engines/device_sampling).",
    )
    args: dict[str, str] = Field(default_factory=dict)

    def offloaded_layers(self, accelerator: str) -> int:
        """The `n_gpu_layers` llama.cpp gets: what the spec says, else all of them on a GPU.

        llama.cpp clamps the count to the model's layers (+1 for the output layer), so
        `ALL_LAYERS` means "everything" for any model without reading its header here."""
        return offloaded_layers(self.gpu_layers, accelerator)

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
    max_queue: int = Field(
        default=64, ge=1, description="Requests waiting for a batch slot; beyond it 429."
    )
    request_timeout_seconds: float = Field(default=300.0, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)


class SensorSettings(_Wire):
    sysfs_root: str = "/sys"
    nvml: bool = False
    npu_smi: str | None = None
    interval_seconds: float = Field(
        default=0.25,
        gt=0,
        description="Sampling period; each sample applies the thermal policy. sysfs zones read "
        "in microseconds; npu-smi takes ~1 s per call, so use >= 1 with it.",
    )
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
    report_condition: bool = Field(
        default=False,
        description="Write the ember.dev/Thermal condition on the runtime's own Pod (needs the "
        "pod's ServiceAccount token and POD_NAME/POD_NAMESPACE).",
    )


class ThermalPolicy(_Wire):
    """Temperature → batch limit, applied by the runtime at every sample. Pure.

    Batch limit::

        T <  throttle : maxBatch
        T >= throttle : clamp(maxBatch − floor((T − throttle) / step), minBatch, maxBatch)

    with hysteresis on the way back up, so a reading that wobbles around a step edge does not
    flap the batch (each change costs a scheduling hiccup): the batch grows only to what a
    reading `hysteresis` °C hotter would allow, and returns to the full batch only once
    T < throttle − hysteresis. Shrinking is never delayed: heat is what hurts p99.

    Example (throttle 78, step 2, max 16, min 4, hysteresis 3): 84 °C → 13; cooling, 82 → 13,
    80 → 14, 77 → 15, 75 → 15, 74.9 → 16.
    """

    adaptive: bool = Field(default=True, description="False: always serve at maxBatchSize.")
    max_batch_size: int = Field(default=16, ge=1, le=256)
    min_batch_size: int = Field(default=4, ge=1, le=256)
    throttle_celsius: float = 78.0
    critical_celsius: float = 90.0
    celsius_per_step: float = Field(default=2.0, gt=0)
    hysteresis_celsius: float = Field(default=3.0, ge=0)
    critical_for_seconds: float = Field(default=60.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"minBatchSize ({self.min_batch_size}) > maxBatchSize ({self.max_batch_size})"
            )
        if self.critical_celsius <= self.throttle_celsius:
            raise ValueError("criticalCelsius must be greater than throttleCelsius")
        return self

    @property
    def release_celsius(self) -> float:
        """Below this the full batch returns and a vacated node is released."""
        return self.throttle_celsius - self.hysteresis_celsius

    def _clamp(self, value: int) -> int:
        return max(self.min_batch_size, min(self.max_batch_size, value))

    def batch_for(self, temp: float) -> int:
        """The memoryless formula (no hysteresis)."""
        if temp < self.throttle_celsius:
            return self.max_batch_size
        steps = math.floor((temp - self.throttle_celsius) / self.celsius_per_step)
        return self._clamp(self.max_batch_size - steps)

    def next_batch(self, temp: float | None, current: int | None) -> int:
        """The batch limit a replica at `temp` °C, now allowed `current`, should be allowed."""
        if not self.adaptive or temp is None or math.isnan(temp):
            return self.max_batch_size  # no policy or no sensor: serve at full size
        target = self.batch_for(temp)
        if current is None:
            return target
        current = self._clamp(current)
        if target <= current:
            return target  # hotter (or unchanged): shrink at once
        if temp < self.release_celsius:
            return self.max_batch_size
        # Cooling inside the band: grow only as far as a reading `hysteresis` hotter allows,
        # and never to the full batch (that needs T < throttle − hysteresis).
        cautious = min(self.batch_for(temp + self.hysteresis_celsius), self.max_batch_size - 1)
        return self._clamp(max(current, cautious))

    def reason(self, temp: float | None, batch: int) -> str:
        """The condition reason for a replica (or node) at `temp` running `batch`."""
        if not self.adaptive:
            return REASON_POLICY_OFF
        if temp is None:
            return REASON_NO_READING
        if temp >= self.critical_celsius:
            return REASON_CRITICAL
        return REASON_THROTTLED if batch < self.max_batch_size else REASON_NORMAL

    def node_reason(self, temp: float | None) -> str:
        """A node's reason (the node agent's): Normal only below throttle − hysteresis, the point
        where a replica gets its full batch back and a tainted node may take replicas again."""
        if temp is None:
            return REASON_NO_READING
        if temp >= self.critical_celsius:
            return REASON_CRITICAL
        return REASON_THROTTLED if temp >= self.release_celsius else REASON_NORMAL


# The condition the runtime keeps on its own Pod (and the node agent on its Node). Its status is
# "True" while the replica is thermally limited (batch below max, or critical).
THERMAL_CONDITION = "ember.dev/Thermal"
REASON_NORMAL = "Normal"
REASON_THROTTLED = "Throttled"
REASON_CRITICAL = "Critical"
REASON_NO_READING = "NoReading"
# No reading because a configured sensor cannot work here (no NVML driver, no npu-smi, no
# sysfs): the message says which and why, so `kubectl describe` answers "why no temperature?".
REASON_SENSOR_UNAVAILABLE = "SensorUnavailable"
REASON_POLICY_OFF = "PolicyOff"
LIMITED_REASONS = frozenset({REASON_THROTTLED, REASON_CRITICAL})
# "84 °C, batch 13/16" (a pod) or "84 °C" (a node); "no reading, batch 16/16" without a sensor;
# a sensor problem follows after "; " ("no reading, batch 16/16; nvml: NVML cannot start ...").
_MESSAGE = re.compile(
    r"^(?:(?P<temp>-?\d+) °C|no reading)(?:, batch (?P<batch>\d+)/(?P<max>\d+))?"
    r"(?:; (?P<detail>.+))?",
    re.DOTALL,
)
# Condition messages are read by people (`kubectl describe`); a library's error can be long.
MAX_DETAIL = 300


@dataclass(frozen=True)
class ThermalReading:
    """What one `ember.dev/Thermal` condition says, typed (whole degrees, like the message)."""

    reason: str
    temperature_celsius: int | None
    max_batch_size: int | None = None  # the limit in force (None on a node's condition)
    capacity: int | None = None
    detail: str | None = None  # why a configured sensor gives no reading, if one does not

    @property
    def limited(self) -> bool:
        return self.reason in LIMITED_REASONS

    def message(self) -> str:
        head = (
            "no reading" if self.temperature_celsius is None else f"{self.temperature_celsius} °C"
        )
        if self.max_batch_size is not None:
            head = f"{head}, batch {self.max_batch_size}/{self.capacity}"
        if self.detail:
            head = f"{head}; {self.detail[:MAX_DETAIL]}"
        return head


def thermal_condition(reading: ThermalReading, now: str) -> dict[str, Any]:
    """The condition as written (lastTransitionTime set by the writer; the kubelet keeps it)."""
    return {
        "type": THERMAL_CONDITION,
        "status": "True" if reading.limited else "False",
        "reason": reading.reason,
        "message": reading.message(),
        "lastTransitionTime": now,
    }


def parse_thermal_condition(conditions: list[dict[str, Any]] | None) -> ThermalReading | None:
    """The `ember.dev/Thermal` condition among a Pod's or Node's conditions, typed; None if absent
    or not in the format `thermal_condition` writes."""
    cond = next((c for c in conditions or [] if c.get("type") == THERMAL_CONDITION), None)
    if cond is None:
        return None
    match = _MESSAGE.match(str(cond.get("message") or ""))
    if match is None:
        return None
    temp, batch, cap = match["temp"], match["batch"], match["max"]
    return ThermalReading(
        reason=str(cond.get("reason") or ""),
        temperature_celsius=None if temp is None else int(temp),
        max_batch_size=None if batch is None else int(batch),
        capacity=None if cap is None else int(cap),
        detail=match["detail"],
    )


class RuntimeConfig(_Wire):
    model_name: str
    format: Literal["gguf", "trtllm-engine"] = "gguf"
    task: Literal["generate", "embed"] = Field(
        default="generate",
        description="generate: completions and chat; embed: /v1/embeddings (engines/embedding).",
    )
    pooling: Literal["mean", "cls", "last"] | None = Field(
        default=None, description="embed: pooling type; None: the GGUF's <arch>.pooling_type."
    )
    model_dir: str = Field(description="Where the model's files are mounted (the source).")
    files: list[ModelFile] = Field(default_factory=list)
    model_layout: Literal["paths", "sha256"] = Field(
        default="paths",
        description="paths: each file at model_dir/<path>; sha256 (http source): each file "
        "at model_dir/<digest>/data, the node agent's view of that one digest (VIEWS_DIR), "
        "with data.partial, failed and waiting beside it.",
    )
    model_wait_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="sha256 layout: how long prewarm waits for the node agent to fetch the files "
        "before it exits with ModelDownloading (the kubelet then starts it again).",
    )
    prewarm_dir: str | None = Field(
        default=None, description="Memory-backed directory that prewarm fills; None: no prewarm."
    )
    accelerator: Literal["cpu", "nvidia-gpu", "npu"] = "cpu"
    engine: EngineSettings = Field(default_factory=EngineSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    sensors: SensorSettings = Field(default_factory=SensorSettings)
    thermal: ThermalPolicy = Field(default_factory=ThermalPolicy)
    termination_log: str = "/dev/termination-log"

    @model_validator(mode="after")
    def _embed_settings(self) -> Self:
        if self.pooling is not None and self.task != "embed":
            raise ValueError("pooling only applies to task embed")
        if self.task == "embed" and self.engine.kind != "llamacpp":
            raise ValueError("task embed requires the llamacpp engine")
        return self

    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def source_file(self, file: ModelFile) -> Path:
        """Where `file` is read from on the model volume."""
        if self.model_layout == "sha256":
            return Path(self.model_dir) / file.sha256 / VIEW_DATA
        return Path(self.model_dir) / file.path

    def to_yaml(self) -> str:
        return dump_yaml(self.model_dump(mode="json", by_alias=True), sort_keys=False)

    def restart_relevant_yaml(self) -> str:
        """The config without its thermal policy: what the pod template's hash covers, so a
        policy change is reloaded by running replicas instead of rolling them."""
        # Fields at their defaults are left out, so adding a field does not roll every
        # existing replica when the operator is upgraded.
        exclude = {"thermal"} | {k for k in _NEWER_FIELDS if getattr(self, k) == _DEFAULTS[k]}
        data = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        return dump_yaml(data, sort_keys=False)


_NEWER_FIELDS = ("model_layout", "model_wait_seconds", "task", "pooling")
_DEFAULTS = {k: RuntimeConfig.model_fields[k].default for k in _NEWER_FIELDS}


def load_config(path: str | Path | None = None) -> RuntimeConfig:
    """Read the config from `path`, else `$EMBER_CONFIG`, else the ConfigMap mount."""
    chosen = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    data = yaml.safe_load(chosen.read_text())
    return RuntimeConfig.model_validate(data)
