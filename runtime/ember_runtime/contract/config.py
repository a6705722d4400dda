"""The runtime config: what the operator renders as YAML into the ConfigMap mounted at
`/etc/ember/config.yaml`, and what the prewarm init container and the runtime sidecar read back
with `load_config`. Field names are camelCase on the wire (like every Kubernetes object) and
snake_case in Python.

Its `thermal:` section (`contract.thermal.ThermalPolicy`) and `engine.adapters` are left out of
the pod template's config hash, so changing them reloads the runtimes instead of restarting
them. The batch ceiling is `engine.maxBatchSize` alone: the governor applies the policy to it
(`BatchLimits`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import Field, TypeAdapter, model_validator

from ember_runtime.contract.cache import VIEW_DATA
from ember_runtime.contract.resource import AdapterView, read_model
from ember_runtime.contract.thermal import (
    DEFAULT_MAX_BATCH_SIZE,
    Batch,
    BatchLimits,
    ThermalPolicy,
)
from ember_runtime.contract.wire import Wire, dump_yaml

log = logging.getLogger(__name__)
DEFAULT_CONFIG_PATH = Path("/etc/ember/config.yaml")
CONFIG_ENV = "EMBER_CONFIG"


class ModelFile(Wire):
    path: str = Field(description="Path relative to the model directory.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)


class FetchFile(Wire):
    url: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=1)


class ModelFetch(Wire):
    secret_ref: str | None = Field(
        default=None, description="Secret in the node agent's namespace with credentials."
    )
    files: list[FetchFile]
    adapters: list[FetchFile] = Field(
        default_factory=list,
        description="spec.adapters[] with a url (http source): fetched like the model's files "
        "into the node cache, linked into the object's adapters view (contract.cache).",
    )

    def digest(self) -> str:
        """`FETCH_HASH_ANNOTATION`'s value: changes with any URL, digest, size or Secret of the
        model's files. Not with the adapters: adding one restarts no pod (the node agent reads
        the spec again by itself, `nodeagent.fetcher`)."""
        text = self.model_dump_json(by_alias=True, exclude_none=True, exclude={"adapters"})
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def all_files(self) -> list[FetchFile]:
        """The model's files and the adapters': every digest this fetch keeps in the cache."""
        return [*self.files, *self.adapters]


def adapter_fetches(adapters: Any) -> list[FetchFile]:
    """An InferenceDeployment's `spec.adapters` (as the API server returns it) → the ones to
    fetch (those with a url: an http source's). Raises ValueError on a shape the CRD refuses."""
    views = TypeAdapter(list[AdapterView]).validate_python(adapters or [])
    return [
        FetchFile(url=a.url, sha256=a.sha256, size_bytes=a.size_bytes)
        for a in views
        if a.url is not None
    ]


def fetch_from_spec(model: Any) -> ModelFetch | None:
    """An InferenceDeployment's `spec.model` (as the API server returns it, read through the one
    view of it, `resource.read_model`) → what to fetch; None for a source other than http.
    Raises ValueError (pydantic's) on a shape the CRD would not have accepted."""
    view = read_model(model)
    http = view.source.http
    if http is None:
        return None
    files = [
        FetchFile(url=http.urls[f.path], sha256=f.sha256, size_bytes=f.size_bytes)
        for f in view.files
        if f.path in http.urls
    ]
    secret = http.secret_ref.name if http.secret_ref is not None else None
    return ModelFetch(secret_ref=secret, files=files)


# Prompt tokens per step beside the decodes (engines/scheduler). 1024: a burst of 16 prompts
# of ~75 tokens goes in one step, as llama-server's n_batch takes it; 256 cut it into five
# steps, each paying the decode rows' 262k-wide output layer again (TTFT p99 1.50 s against
# llama-server's 1.21 s at 16 clients; 1.13 s at 1024, in runs of bench/runtime_bench.py with
# `--servers ember:stepTokens=...` at 32 requests; the default's full run is in bench/results).
DEFAULT_STEP_TOKENS = 1024
# Prompt tokens of one sequence per step (fast mode), inside the step's budget; a tail of up
# to half a chunk more goes with the last chunk (engines/scheduler). Why a cap: one call of n
# prompt tokens attends over every cell it reaches, the masked half included, so a 1,540-token
# prompt cut at 1024 costs more attention than one cut at 256. The gain is small: a lone
# prompt's first token against llama-server's, RAG 1.04x at 1024 and 1.02x at 256, code edit
# 1.00x and 0.98x (bench/results/prefill_chunk.md; overlapping ranges, the same direction in
# each of three runs). At 1 and 4 clients no change showed beyond the run-to-run spread
# (bench/results/speculative-chunk-trial.md).
DEFAULT_CHUNK_TOKENS = 256
# A draft model's batch (engines/draft.py): the rows of one catch-up decode, sized into memory.
DRAFT_BATCH_TOKENS = 512
# llama.cpp offloads min(n_gpu_layers, layers + 1): any count above every model's depth is "all".
ALL_LAYERS = 999
# Fast mode keeps all sequences in one KV pool (llama-server's -kvu); deterministic mode never.
# Any mix of decode rows and prompt chunks is one micro-batch, and a burst with a shared system
# prompt computes it once (shared-chat at 16 clients: 2.2x the tok/s of per-sequence streams,
# TTFT p99 0.55 s against 3.97 s; `--servers ember:kvUnified=...`, 32 requests).
UNIFIED_BY_DEFAULT = True


def offloaded_layers(gpu_layers: int | None, accelerator: str) -> int:
    """The `n_gpu_layers` llama.cpp gets: what the spec says, else all of them on a GPU."""
    if gpu_layers is not None:
        return gpu_layers
    return ALL_LAYERS if accelerator == "nvidia-gpu" else 0


def unified_kv(deterministic: bool, setting: bool | None = None) -> bool:
    """The KV layout the engine uses: one pool, or one stream per sequence."""
    if deterministic:
        return False
    return UNIFIED_BY_DEFAULT if setting is None else setting


class AdapterConfig(Wire):
    """A LoRA adapter served on the shared base model, under its own model id (issue 47)."""

    name: str = Field(
        min_length=1,
        max_length=253,
        description="The model id clients ask for; must differ from the base's and each other's.",
    )
    path: str = Field(description="The adapter GGUF: absolute, or relative to the model dir.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    scale: float = Field(default=1.0, ge=0.0, le=100.0, description="LoRA scale (alpha/rank x).")


class SpeculationConfig(Wire):
    """Speculative decoding from the request's own text (engines/speculative.py, issue 48)."""

    mode: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: draft from the prompt and the output where it pays (each sequence "
        "stops drafting while its drafts are not kept often enough); off: never.",
    )
    max_draft: int = Field(default=8, ge=1, le=32, description="Tokens drafted per step.")
    ngram_min: int = Field(default=2, ge=1, le=16, description="Shortest suffix looked up.")
    ngram_max: int = Field(default=4, ge=1, le=16, description="Longest suffix looked up.")
    sequences: int = Field(
        default=4, ge=1, le=64, description="Sequences that may draft in one step."
    )
    draft_model: str | None = Field(
        default=None,
        description="A file of `files` (not the first: the served model) whose smaller model "
        "drafts instead of the lookup; its vocabulary must be the served model's.",
    )

    @model_validator(mode="after")
    def _ngram_order(self) -> Self:
        if self.ngram_min > self.ngram_max:
            raise ValueError("engine.speculation.ngramMin must not exceed ngramMax")
        return self

    def draft_rows(self, deterministic: bool = False, kind: str = "llamacpp") -> int:
        """Rows a step may add for drafts: what the output buffer grows by (0 when off)."""
        if self.mode == "off" or deterministic or kind != "llamacpp":
            return 0
        return self.max_draft * self.sequences


class EngineConfig(Wire):
    kind: Literal["llamacpp", "tensorrt-llm"] = "llamacpp"
    context_length: int = Field(default=2048, ge=64)
    max_batch_size: Batch = Field(
        default=DEFAULT_MAX_BATCH_SIZE,
        description="Capacity: sequences the engine allocates for; the thermal policy's ceiling.",
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
    chunk_tokens: int = Field(
        default=DEFAULT_CHUNK_TOKENS,
        ge=16,
        le=4096,
        description="Prompt tokens of one sequence per step, within stepTokens (fast mode).",
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
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="llamacpp: LoRA adapters served beside the base, reloaded live from this "
        "file (server/adapters.py).",
    )
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    args: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_adapters(self) -> Self:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError("engine.adapters names must be unique")
        return self

    def offloaded_layers(self, accelerator: str) -> int:
        """The `n_gpu_layers` llama.cpp gets: what the spec says, else all of them on a GPU.

        llama.cpp clamps the count to the model's layers (+1 for the output layer), so
        `ALL_LAYERS` means "everything" for any model without reading its header here."""
        return offloaded_layers(self.gpu_layers, accelerator)

    def draft_rows(self) -> int:
        """Rows a step may spend on speculative drafts (engines/speculative.py)."""
        return self.speculation.draft_rows(self.llamacpp_modes().deterministic, self.kind)

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


class SamplingDefaults(Wire):
    """What a request's left-out sampling fields mean on this deployment (`spec.sampling`).

    Unset, a field keeps the server's default, OpenAI's (docs/sampling.md): temperature 1 with
    nothing filtered. llama-server's defaults are temperature 0.8, topP 0.95, topK 40 and
    minP 0.05; setting them here makes Ember sample the distribution a llama-server client gets
    from the same body. A field the request sends always wins."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, description="0: off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)

    def given(self) -> dict[str, float | int]:
        """The fields set here, by their request names (snake_case, as OpenAI spells them)."""
        return {name: value for name, value in self if value is not None}

    def llamacpp_only(self) -> list[str]:
        """The set fields only the llamacpp engine implements (the `sampling` feature)."""
        return [n for n in ("top_k", "min_p", "repeat_penalty") if getattr(self, n) is not None]


class ServerConfig(Wire):
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


class SensorConfig(Wire):
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


class RuntimeConfig(Wire):
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
        "at model_dir/<digest>/data, the node agent's view of that one digest (contract.cache), "
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
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    sensors: SensorConfig = Field(default_factory=SensorConfig)
    thermal: ThermalPolicy = Field(default_factory=ThermalPolicy)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    termination_log: str = "/dev/termination-log"

    @model_validator(mode="after")
    def _embed_settings(self) -> Self:
        if self.pooling is not None and self.task != "embed":
            raise ValueError("pooling only applies to task embed")
        if self.task == "embed" and self.engine.kind != "llamacpp":
            raise ValueError("task embed requires the llamacpp engine")
        return self

    @model_validator(mode="after")
    def _adapter_settings(self) -> Self:
        adapters = self.engine.adapters
        if adapters and (self.engine.kind != "llamacpp" or self.task != "generate"):
            raise ValueError("engine.adapters requires the llamacpp engine and task generate")
        if any(a.name == self.model_name for a in adapters):
            raise ValueError("an adapter's name must differ from modelName (the base's id)")
        return self

    @model_validator(mode="after")
    def _sampling_settings(self) -> Self:
        given = self.sampling.given()
        if given and self.task != "generate":
            raise ValueError("sampling defaults require task generate")
        only = self.sampling.llamacpp_only()
        if only and self.engine.kind != "llamacpp":
            raise ValueError(f"sampling {', '.join(only)} requires the llamacpp engine")
        return self

    @model_validator(mode="after")
    def _draft_settings(self) -> Self:
        draft = self.engine.speculation.draft_model
        if draft is None:
            return self
        if self.engine.kind != "llamacpp" or self.task != "generate":
            raise ValueError("engine.speculation.draftModel requires llamacpp and task generate")
        if draft not in [f.path for f in self.files[1:]]:
            raise ValueError(
                f"engine.speculation.draftModel {draft!r} must name a file of files other than "
                "the first (the served model)"
            )
        return self

    def draft_file(self) -> ModelFile | None:
        """The draft model's file (`engine.speculation.draftModel`), or None."""
        draft = self.engine.speculation.draft_model
        return next((f for f in self.files if f.path == draft), None) if draft else None

    def adapter_file(self, adapter: AdapterConfig) -> Path:
        """Where `adapter` is read from: its path, under the model dir unless absolute."""
        return Path(self.model_dir) / adapter.path

    def limits(self) -> BatchLimits:
        """The thermal policy for this engine's capacity: what the governor applies (a floor
        above the capacity is capped by it; the CRD refuses engine.minBatchSize > maxBatchSize)."""
        return self.thermal.limits(self.engine.max_batch_size)

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
        # The LoRA adapters are reloaded live too (server/adapters.py): adding or removing one
        # restarts nothing (their files come through mounts the pods already have).
        data["engine"].pop("adapters")
        return dump_yaml(data, sort_keys=False)


_NEWER_FIELDS = ("model_layout", "model_wait_seconds", "task", "pooling", "sampling")
_DEFAULTS = {
    k: RuntimeConfig.model_fields[k].get_default(call_default_factory=True) for k in _NEWER_FIELDS
}


def load_config(path: str | Path | None = None) -> RuntimeConfig:
    """Read the config from `path`, else `$EMBER_CONFIG`, else the ConfigMap mount."""
    chosen = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    data = yaml.safe_load(chosen.read_text())
    return RuntimeConfig.model_validate(data)
