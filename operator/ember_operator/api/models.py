"""The InferenceDeployment API as pydantic v2 models: the single source of truth.

`crdgen` turns these models into the CRD's OpenAPI v3 schema (descriptions, defaults, enums,
bounds and the CEL rules in `x-kubernetes-validations`), and the operator parses every object it
receives with them, so the API server and the operator can never disagree about the shape.
CEL rules are attached with `json_schema_extra` next to the fields they guard; every rule carries a
message written for the person running `kubectl apply`, not for the operator's author.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from ember_runtime.contract.thermal import DEFAULT_MAX_BATCH_SIZE, DEFAULTS, Batch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from ember_operator import quantity

# The API server's own Quantity grammar (k8s.io/apimachinery resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
QUANTITY_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": QUANTITY_PATTERN,
    "x-kubernetes-int-or-string": True,
}


def _check_quantity(value: int | str) -> str:
    text = str(value)
    # The OpenAPI pattern, which is all the API server checks, lets through what Kubernetes'
    # own parser refuses (a fractional exponent, "1e-.6") and sizes nothing can hold
    # ("1e76936"). The operator computes with these values, so it holds them to the parser's
    # grammar and to int64: such a spec becomes InvalidSpec with this message, not a traceback.
    try:
        if not _QUANTITY_RE.match(text):
            raise ValueError
        value_ = quantity.parse(text)
    except quantity.OutOfRange:
        raise
    except ValueError:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 512Mi, 2Gi, 500m)") from None
    if abs(value_) >= 2**63:
        raise ValueError(f"{text!r} is too large for a Kubernetes quantity")
    return text


# Accepts 512Mi or a bare integer like the API server does; always a string once parsed.
Quantity = Annotated[int | str, AfterValidator(_check_quantity), WithJsonSchema(QUANTITY_SCHEMA)]


def cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; a message is mandatory so users read English."""
    return {"rule": rule, "message": message, **extra}


def rules(*entries: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(entries)}


# Nested objects default to {} so the API server fills their own defaults (and CEL sees them)
# even when the user leaves the whole block out.
OBJECT_DEFAULT: dict[str, Any] = {"default": {}}


class CrdModel(BaseModel):
    """camelCase on the wire like every Kubernetes object; snake_case in Python."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# ----------------------------------------------------------------------------- enums


class ModelFormat(StrEnum):
    GGUF = "gguf"
    TRTLLM_ENGINE = "trtllm-engine"


class EngineKind(StrEnum):
    LLAMACPP = "llamacpp"
    TENSORRT_LLM = "tensorrt-llm"


class AcceleratorKind(StrEnum):
    CPU = "cpu"
    NVIDIA_GPU = "nvidia-gpu"
    NPU = "npu"


class ThermalPolicyMode(StrEnum):
    ADAPTIVE = "adaptive"
    STATIC = "static"
    # The former name of STATIC, still accepted and meaning the same. Deprecated: YAML 1.1 reads
    # a bare `off` as the boolean false, which the API server refuses, so it must be quoted.
    OFF = "off"


class ModelTask(StrEnum):
    GENERATE = "generate"
    EMBED = "embed"


class Pooling(StrEnum):
    """How an embedding model's token vectors become one vector per input (llama.cpp's pooling
    types that give one; `none` and `rank` do not, so /v1/embeddings cannot serve them)."""

    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


# ----------------------------------------------------------------------------- model


class HostPathSource(CrdModel):
    path: str = Field(
        max_length=4096,
        description="Absolute directory on the node holding the model files. It must be one "
        "of the directories the cluster allows for models (the chart's modelHostPaths.allowed, "
        "enforced by a ValidatingAdmissionPolicy), or below one, and never the node agent's "
        "cache (use an http source for that).",
        json_schema_extra=rules(
            cel("self.startsWith('/')", "model.source.hostPath.path must be an absolute path"),
            # The admission policy compares prefixes: `allowed/../etc` must never reach it.
            cel(
                "!self.matches('(^|/)[.][.]?(/|$)')",
                "model.source.hostPath.path must not contain '.' or '..' segments",
            ),
        ),
    )


class PvcSource(CrdModel):
    claim_name: str = Field(
        min_length=1, max_length=253, description="PersistentVolumeClaim in the same namespace."
    )
    sub_path: str | None = Field(
        default=None,
        max_length=4096,
        description="Directory inside the volume that holds the model files.",
        json_schema_extra=rules(
            cel(
                "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                "model.source.pvc.subPath must be relative and must not contain '..'",
            )
        ),
    )


class ImageSource(CrdModel):
    reference: str = Field(
        min_length=1, max_length=1024, description="OCI image whose filesystem holds the files."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy for the model image."
    )


class LocalSecretRef(CrdModel):
    name: str = Field(
        min_length=1,
        max_length=253,
        description="Name of a Secret in the node agent's own namespace (never the object's): "
        "keys `token` (sent as a bearer token) or `username` and `password` (basic auth), and "
        "`urlPrefix`, the only URLs the credentials are sent to.",
        json_schema_extra=rules(
            cel(
                "self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')",
                "model.source.http.secretRef.name must be a Secret name (lowercase DNS subdomain)",
            )
        ),
    )


# Scheme, then a host without user info (credentials belong in the Secret, not the spec).
URL_PATTERN = "^https?://[^/?#@\\\\s]+([/?#].*)?$"


Url = Annotated[
    str,
    Field(
        max_length=2048,
        json_schema_extra=rules(
            cel(
                f"self.matches('{URL_PATTERN}')",
                "model.source.http.urls values must be http:// or https:// URLs with a host "
                "and no user info",
            )
        ),
    ),
]


class HttpSource(CrdModel):
    """Files fetched over HTTP(S) by the node agent into its content-addressed cache."""

    urls: dict[str, Url] = Field(
        min_length=1,
        max_length=64,
        description="URL of each file, keyed by its `model.files[].path`; http:// or https://. "
        "The node agent verifies every byte against the file's sha256 and sizeBytes.",
    )
    secret_ref: LocalSecretRef | None = Field(
        default=None, description="Credentials for the origin (read by the node agent only)."
    )


_ONE_SOURCE = cel(
    "[has(self.hostPath), has(self.pvc), has(self.image), has(self.http)].filter(x, x).size() == 1",
    "model.source must set exactly one of hostPath, pvc, image or http",
)


class ModelSource(CrdModel):
    """Where the model's files come from; exactly one member is set."""

    model_config = ConfigDict(json_schema_extra=rules(_ONE_SOURCE))

    host_path: HostPathSource | None = Field(default=None, description="Node-local directory.")
    pvc: PvcSource | None = Field(default=None, description="A PersistentVolumeClaim.")
    image: ImageSource | None = Field(default=None, description="An OCI image volume.")
    http: HttpSource | None = Field(
        default=None, description="HTTP(S) URLs, fetched and cached on each node by Ember."
    )


class ModelFileSpec(CrdModel):
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Path of the file relative to the source directory.",
        json_schema_extra=rules(
            cel(
                "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                "model.files[].path must be a relative path without '..' components",
            )
        ),
    )
    sha256: str = Field(
        max_length=64,
        description="Lowercase hex SHA-256 of the file; prewarm refuses a file that differs.",
        json_schema_extra=rules(
            cel(
                "self.matches('^[0-9a-f]{64}$')",
                "model.files[].sha256 must be exactly 64 lowercase hexadecimal characters",
            )
        ),
    )
    size_bytes: int = Field(ge=1, description="Size of the file in bytes.")


class ModelSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.format != 'gguf' || self.files.exists(f, f.path.endsWith('.gguf'))",
                "a gguf model must list at least one file ending in .gguf",
            ),
            cel(
                "!has(self.source.http) || self.files.all(f, f.path in self.source.http.urls)",
                "model.source.http.urls must have a URL for every path in model.files",
            ),
            cel(
                "!has(self.source.http) || "
                "self.source.http.urls.all(k, self.files.exists(f, f.path == k))",
                "model.source.http.urls may only name paths listed in model.files",
            ),
            cel(
                "!has(self.pooling) || self.task == 'embed'",
                "model.pooling only applies to model.task embed",
            ),
        )
    )

    name: str = Field(
        min_length=1, max_length=253, description="Model name served to clients (OpenAI `model`)."
    )
    format: ModelFormat = Field(default=ModelFormat.GGUF, description="On-disk format.")
    source: ModelSource = Field(description="Where the files come from.")
    files: list[ModelFileSpec] = Field(
        min_length=1, max_length=64, description="Every file of the model, verified by prewarm."
    )
    task: ModelTask = Field(
        default=ModelTask.GENERATE,
        description="generate: serve /v1/completions and /v1/chat/completions; embed: serve "
        "/v1/embeddings (one L2-normalised vector per input) and refuse the other two.",
    )
    pooling: Pooling | None = Field(
        default=None,
        description="embed: how the token vectors of an input become one vector (mean, cls or "
        "last). Default: the GGUF's `<arch>.pooling_type`; a model whose GGUF names none "
        "(a generative model) needs it set here, else the runtime refuses to start.",
    )


# ----------------------------------------------------------------------------- engine


class SpeculationSpec(CrdModel):
    """Speculative decoding from the request's own text (prompt lookup; no second model)."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.ngramMin <= self.ngramMax",
                "engine.speculation.ngramMin must be less than or equal to ngramMax",
            )
        )
    )

    mode: Literal["auto", "off"] = Field(
        default="auto",
        description=(
            "auto: each sequence drafts from its prompt and output while enough of its drafts "
            "are kept to pay for their rows (measured at start on the node), and pauses "
            "otherwise; off: never. A request may send speculative: false."
        ),
    )
    max_draft: int = Field(default=8, ge=1, le=32, description="Tokens drafted per step at most.")
    ngram_min: int = Field(default=2, ge=1, le=16, description="Shortest suffix looked up.")
    ngram_max: int = Field(default=4, ge=1, le=16, description="Longest suffix looked up.")
    sequences: int = Field(
        default=4,
        ge=1,
        le=64,
        description=(
            "Sequences that may draft in one step; their rows' logits are sized into the "
            "replica's memory (maxDraft x sequences rows)."
        ),
    )


class EngineSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.minBatchSize <= self.maxBatchSize",
                "engine.minBatchSize must be less than or equal to engine.maxBatchSize",
            ),
            cel(
                "!has(self.threads) || self.kind == 'llamacpp'",
                "engine.threads only applies to the llamacpp engine",
            ),
            cel(
                "!has(self.deterministic) || !self.deterministic || self.kind == 'llamacpp'",
                "engine.deterministic only applies to the llamacpp engine",
            ),
            cel(
                "!has(self.gpuLayers) || self.kind == 'llamacpp'",
                "engine.gpuLayers only applies to the llamacpp engine",
            ),
            cel(
                "!has(self.speculation) || self.speculation.mode == 'off' || "
                "self.kind == 'llamacpp'",
                "engine.speculation only applies to the llamacpp engine",
            ),
        )
    )

    kind: EngineKind = Field(default=EngineKind.LLAMACPP, description="Inference engine.")
    context_length: int = Field(
        default=2048, ge=64, le=1_048_576, description="Context window in tokens."
    )
    # The defaults are Ember's one set (ember_runtime.contract.thermal), as the runtime's.
    max_batch_size: Batch = Field(
        default=DEFAULT_MAX_BATCH_SIZE,
        description="Largest batch the thermal controller may allow.",
    )
    min_batch_size: Batch = Field(
        default=DEFAULTS.min_batch_size,
        description="Smallest batch the thermal controller may shrink to.",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="llamacpp threads; by default derived from the runtime container's CPU limit.",
    )
    deterministic: bool = Field(
        default=False,
        description=(
            "llamacpp: make a request's greedy output independent of the requests batched with "
            "it (decode calls no wider than a width probed at start on the node's CPU, each "
            "prompt chunk alone, no repacked weights, no prefix cache). Costs throughput under "
            "load (see the README); off: batching as llama-server does it."
        ),
    )
    gpu_layers: int | None = Field(
        default=None,
        ge=0,
        le=999,
        description=(
            "llamacpp on nvidia-gpu: layers offloaded to the GPU, with their KV cache (default: "
            "every layer; 0 keeps the model on the CPU). Offloaded layers' weights and KV cache "
            "live in GPU memory, so the sized memory request leaves them out (sizing.yaml "
            "in the ConfigMap shows deviceMemory)."
        ),
    )
    speculation: SpeculationSpec | None = Field(
        default=None,
        description=(
            "llamacpp: speculative decoding from the prompt and the output (default: auto; "
            "never with deterministic). Greedy text keeps its tokens and sampled text its "
            "distribution."
        ),
    )
    draft_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description=(
            "llamacpp: the path of one of model.files (not the first, which is the served "
            "model) holding a smaller model of the same vocabulary, which drafts the tokens "
            "speculation verifies instead of the lookup. Fetched, verified and prewarmed with "
            "the model; prewarm refuses one whose vocabulary differs (DraftVocabularyMismatch)."
        ),
    )
    args: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description=(
            "Extra engine arguments, passed through verbatim (e.g. n_batch: '512'). "
            "exactBatching, prefixCache and repack are deprecated (use deterministic) and "
            "are removed in the next release."
        ),
    )


class SamplingSpec(CrdModel):
    """Defaults for the sampling fields a request leaves out; a field it sends always wins."""

    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="Default temperature (unset: 1, OpenAI's)."
    )
    top_p: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Default top_p (unset: 1, nothing filtered).",
    )
    top_k: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="llamacpp: default top_k (unset or 0: off; llama-server's is 40).",
    )
    min_p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="llamacpp: default min_p (unset: 0, off; llama-server's is 0.05).",
    )
    repeat_penalty: float | None = Field(
        default=None,
        gt=0.0,
        le=10.0,
        description="llamacpp: default repeat_penalty (unset: 1, off).",
    )


# ----------------------------------------------------------------------------- accelerator


class AcceleratorSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.kind == 'cpu' || self.count >= 1",
                "accelerator.count must be at least 1 for nvidia-gpu and npu",
            )
        )
    )

    kind: AcceleratorKind = Field(default=AcceleratorKind.CPU, description="Accelerator type.")
    count: int = Field(
        default=1,
        ge=0,
        le=16,
        description="Devices per replica (nvidia.com/gpu or ember.dev/npu); ignored for cpu.",
    )


# ----------------------------------------------------------------------------- placement


class Toleration(CrdModel):
    key: str | None = Field(default=None, max_length=317, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Match rule.")
    value: str | None = Field(default=None, max_length=63, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound."
    )


class PlacementSpec(CrdModel):
    sites: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list,
        max_length=64,
        description="Sites (node label ember.dev/site) to run on; replicas spread across them. "
        "Empty: any node, still spread by site and node where labels exist.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Extra node labels the pods require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations for the pods."
    )


# ----------------------------------------------------------------------------- prewarm, thermal


class PrewarmSpec(CrdModel):
    enabled: bool = Field(
        default=True,
        description="Verify and load the model into a memory-backed volume before serving.",
    )
    shared_memory_limit: Quantity | None = Field(
        default=None,
        description="Size of the memory-backed volume; must cover the sum of the file sizes. "
        "Default: the total file size plus 64Mi.",
    )


class ThermalSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.criticalCelsius > self.throttleCelsius",
                "thermal.criticalCelsius must be greater than thermal.throttleCelsius",
            )
        )
    )

    policy: ThermalPolicyMode = Field(
        default=ThermalPolicyMode.ADAPTIVE,
        description="Thermal policy. adaptive: lower the batch (down to engine.minBatchSize) as "
        "the device heats. static: serve at engine.maxBatchSize always, no thermal batch "
        'control. "off": a deprecated name for static; quote it in YAML, where a bare off is the '
        "boolean false.",
    )
    # Whole degrees and seconds here; the defaults are the runtime's (contract.thermal).
    throttle_celsius: int = Field(
        default=int(DEFAULTS.throttle_celsius),
        ge=30,
        le=130,
        description="Above this the batch size shrinks.",
    )
    critical_celsius: int = Field(
        default=int(DEFAULTS.critical_celsius),
        ge=30,
        le=130,
        description="Above this the replica stops taking work.",
    )
    celsius_per_step: int = Field(
        default=int(DEFAULTS.celsius_per_step),
        ge=1,
        le=20,
        description="Degrees per batch-size step.",
    )
    critical_for_seconds: int = Field(
        default=int(DEFAULTS.critical_for_seconds),
        ge=1,
        le=3600,
        description="How long critical must last before acting.",
    )

    @property
    def adaptive(self) -> bool:
        """The runtime controls the batch; static and its old name "off" both mean it does not."""
        return self.policy == ThermalPolicyMode.ADAPTIVE


# ----------------------------------------------------------------------------- server


class SecretKeyRef(CrdModel):
    name: str = Field(min_length=1, max_length=253, description="Secret in the same namespace.")
    key: str = Field(min_length=1, max_length=253, description="Key within the Secret.")


class ServerSpec(CrdModel):
    port: int = Field(default=8080, ge=1024, le=65535, description="HTTP port (non-root: >1023).")
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the API key clients must send."
    )


# A Kubernetes resource name: an optional DNS-subdomain prefix (at most 253 characters) and a
# name of at most 63 (cpu, memory, hugepages-2Mi, nvidia.com/gpu, ember.dev/npu). Checked at
# admission: otherwise a typo passes here and surfaces only when the Deployment apply is refused.
_RESOURCE_NAME = (
    "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def _resource_map(what: str) -> Any:
    return Field(
        default_factory=dict,
        max_length=16,  # bounds the rule's cost, as the API server requires
        description=f"Resource {what}.",
        json_schema_extra=rules(
            cel(
                f"self.all(k, size(k) <= 317 && k.matches('{_RESOURCE_NAME}'))",
                f"resources.{what} keys must be resource names such as cpu, memory or "
                "nvidia.com/gpu",
            )
        ),
    )


class ResourceRequirements(CrdModel):
    requests: dict[str, Quantity] = _resource_map("requests")
    limits: dict[str, Quantity] = _resource_map("limits")


# ----------------------------------------------------------------------------- rollout


class LabelSelectorRequirement(CrdModel):
    key: str = Field(min_length=1, max_length=317, description="Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="Match rule.")
    values: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list, max_length=64, description="Values for In and NotIn."
    )


class NodeLabelSelector(CrdModel):
    match_labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Labels a node must carry."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16, description="Expressions a node must satisfy."
    )


_ONE_ORDER = cel(
    "[has(self.sites), has(self.selector), has(self.count), has(self.percent)]"
    ".filter(x, x).size() == 1",
    "each rollout wave must set exactly one of sites, selector, count or percent",
)


class RolloutWave(CrdModel):
    """One wave of sites. Sites already in an earlier wave are never taken again; `count` and
    `percent` take the next sites in name order."""

    model_config = ConfigDict(json_schema_extra=rules(_ONE_ORDER))

    name: str = Field(
        min_length=1,
        max_length=63,
        description="Wave name, shown in status and events (e.g. canary).",
        json_schema_extra=rules(
            cel(
                "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
                "rollout.waves[].name must be a lowercase DNS label",
            )
        ),
    )
    sites: list[Annotated[str, Field(min_length=1, max_length=63)]] | None = Field(
        default=None,
        max_length=1000,
        description="Explicit sites (node label ember.dev/site).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    selector: NodeLabelSelector | None = Field(
        default=None, description="The sites of the nodes this selector matches."
    )
    count: int | None = Field(default=None, ge=1, le=10000, description="The next N sites.")
    percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="This share of all sites (rounded up, at least one), taken from the next.",
    )
    bake_seconds: int = Field(
        default=300,
        ge=0,
        le=604_800,
        description="How long every site of the wave must stay healthy on the new version "
        "before the next wave starts.",
    )


class HealthGate(CrdModel):
    ready_timeout_seconds: int = Field(
        default=600,
        ge=10,
        le=86_400,
        description="A site whose new replicas are not all Ready by then fails its gate "
        "(a model that does not load, an OOM kill).",
    )
    max_error_rate_increase_percent: int = Field(
        default=2,
        ge=0,
        le=100,
        description="A site fails when its new replicas' server-error rate exceeds the "
        "previous version's on the same site by more than this many percentage points.",
    )
    max_ttft_ratio_percent: int = Field(
        default=150,
        ge=100,
        le=10_000,
        description="A site fails when its new replicas' TTFT p99 exceeds this percentage of "
        "the previous version's on the same site. Requests served while heat throttled the "
        "replica are not counted against the new version.",
    )
    min_requests: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Requests a site's replicas must have finished on each version before "
        "their TTFT and error rates are compared; with fewer, only readiness is judged.",
    )


class UnreachablePolicy(StrEnum):
    SKIP = "Skip"
    HALT = "Halt"


class RolloutSpec(CrdModel):
    """Site by site: each wave's sites stage the new model, change, bake and pass their health
    gate before the next wave starts; a failed gate rolls the changed sites back from their node
    caches."""

    waves: list[RolloutWave] = Field(
        min_length=1,
        max_length=32,
        description="Waves in order. Sites left over after the last wave form a final wave "
        "named `rest` with the last wave's bake time.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    gate: HealthGate = Field(
        default_factory=HealthGate,
        description="The health gate every site of a wave must pass.",
        json_schema_extra=OBJECT_DEFAULT,
    )
    unreachable_after_seconds: int = Field(
        default=600,
        ge=10,
        le=604_800,
        description="A site none of whose nodes is Ready counts as neither healthy nor failed "
        "for this long, then as unreachable.",
    )
    on_unreachable: UnreachablePolicy = Field(
        default=UnreachablePolicy.HALT,
        description="Halt: an unreachable site halts the rollout (nothing rolls back). Skip: "
        "it is left on its version and the rollout goes on without it.",
    )
    paused: bool = Field(
        default=False, description="Hold the rollout where it is (sites keep their versions)."
    )
    rollback: bool = Field(
        default=False,
        description="Put every changed site back on the previous version, from its node cache, "
        "and hold there until the spec changes again.",
    )


# ----------------------------------------------------------------------------- adapters


class AdapterSpec(CrdModel):
    """A LoRA adapter of the base model, served under its own model name."""

    name: str = Field(
        min_length=1,
        max_length=253,
        description="The model name clients ask for (OpenAI `model`), in /v1/models and the "
        "gateway; must differ from model.name.",
        json_schema_extra=rules(
            cel("!self.matches('\\\\s')", "adapters[].name must not contain whitespace")
        ),
    )
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="The adapter GGUF, relative to the model's source directory (hostPath, pvc, "
        "image). With an http source: its name beside the other adapters.",
        json_schema_extra=rules(
            cel(
                "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                "adapters[].path must be a relative path without '..' components",
            )
        ),
    )
    url: Url | None = Field(
        default=None,
        description="With an http model source (and only there): where the node agent fetches "
        "it, once per site, verified like the model's files.",
    )
    sha256: str = Field(
        max_length=64,
        description="Lowercase hex SHA-256 of the file; a file that differs is refused (the "
        "base keeps serving, status says why).",
        json_schema_extra=rules(
            cel(
                "self.matches('^[0-9a-f]{64}$')",
                "adapters[].sha256 must be exactly 64 lowercase hexadecimal characters",
            )
        ),
    )
    size_bytes: int = Field(ge=1, le=2**40, description="Size of the file in bytes.")
    scale: float = Field(default=1.0, ge=0.0, le=100.0, description="LoRA scale.")


# ----------------------------------------------------------------------------- scaling


class ScalingSpec(CrdModel):
    """Replicas follow demand, down to zero: the site gateway holds requests for a model with
    no ready replica, asks for one through the scale subresource and releases them when it is
    Ready; it scales an idle model down after idleSeconds."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.minReplicas <= self.maxReplicas",
                "scaling.minReplicas must be less than or equal to scaling.maxReplicas",
            )
        )
    )

    min_replicas: int = Field(
        default=0, ge=0, le=1000, description="Fewest replicas; 0 lets the model scale to zero."
    )
    max_replicas: int = Field(default=1, ge=1, le=1000, description="Most replicas.")
    idle_seconds: int = Field(
        default=300,
        ge=5,
        le=604_800,
        description="How long demand must stay below the replicas before one is removed "
        "(scale-down stabilization; also how long an idle model stays loaded).",
    )
    target_in_flight: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Requests in flight per replica the gateway scales for (default: "
        "engine.maxBatchSize).",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="When a site's memory is short, idle models of the lowest priority are "
        "scaled down first, least recently used first among equals; a model is never scaled "
        "down for one of lower priority.",
    )


# ----------------------------------------------------------------------------- spec


_SPEC_RULES = rules(
    cel(
        "!has(self.engine.gpuLayers) || self.engine.gpuLayers == 0 "
        "|| self.accelerator.kind == 'nvidia-gpu'",
        "engine.gpuLayers above 0 requires accelerator.kind nvidia-gpu",
    ),
    cel(
        "self.engine.kind != 'tensorrt-llm' || self.accelerator.kind == 'nvidia-gpu'",
        "engine.kind tensorrt-llm requires accelerator.kind nvidia-gpu",
    ),
    cel(
        "self.model.format != 'trtllm-engine' || self.engine.kind == 'tensorrt-llm'",
        "model.format trtllm-engine requires engine.kind tensorrt-llm",
    ),
    cel(
        "self.model.format != 'gguf' || self.engine.kind == 'llamacpp'",
        "model.format gguf requires engine.kind llamacpp",
    ),
    cel(
        "self.model.task != 'embed' || self.engine.kind == 'llamacpp'",
        "model.task embed requires engine.kind llamacpp",
    ),
    # Prewarm is what waits for the node agent's cache and lays the files out under their
    # names; without it the runtime would look for them before they exist.
    cel(
        "!has(self.model.source.http) || self.prewarm.enabled",
        "model.source.http requires prewarm.enabled",
    ),
    cel(
        "!has(self.adapters) || self.adapters.size() == 0 || "
        "(self.engine.kind == 'llamacpp' && self.model.task == 'generate')",
        "adapters require engine.kind llamacpp and model.task generate",
    ),
    cel(
        "!has(self.adapters) || self.adapters.all(a, a.name != self.model.name)",
        "adapters[].name must differ from model.name",
    ),
    cel(
        "!has(self.adapters) || self.adapters.all(a, has(a.url) == has(self.model.source.http))",
        "adapters[].url is required with model.source.http and only there (with any other "
        "source the adapter lies in the model's directory)",
    ),
    cel(
        "!has(self.engine.draftModel) || (self.model.files.exists(f, f.path == "
        "self.engine.draftModel) && self.model.files[0].path != self.engine.draftModel "
        "&& self.engine.draftModel.endsWith('.gguf'))",
        "engine.draftModel must be the path of a .gguf file in model.files other than the "
        "first (the served model)",
    ),
    cel(
        "!has(self.engine.draftModel) || (self.engine.kind == 'llamacpp' && "
        "self.model.task == 'generate' && !self.engine.deterministic && "
        "(!has(self.engine.speculation) || self.engine.speculation.mode != 'off'))",
        "engine.draftModel requires engine.kind llamacpp, model.task generate and speculation "
        "on (not deterministic, speculation.mode not off)",
    ),
    cel(
        "!has(self.sampling) || self.model.task == 'generate'",
        "sampling applies to model.task generate only",
    ),
    cel(
        "!has(self.sampling) || self.engine.kind == 'llamacpp' || (!has(self.sampling.topK) "
        "&& !has(self.sampling.minP) && !has(self.sampling.repeatPenalty))",
        "sampling.topK, minP and repeatPenalty require engine.kind llamacpp",
    ),
    cel(
        "!has(self.scaling) || !has(self.rollout)",
        "scaling and rollout cannot be combined: a rollout fixes each site's replicas",
    ),
)


class InferenceDeploymentSpec(CrdModel):
    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    replicas: int = Field(default=1, ge=0, le=1000, description="Number of serving pods.")
    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="Engine settings.", json_schema_extra=OBJECT_DEFAULT
    )
    accelerator: AcceleratorSpec = Field(
        default_factory=AcceleratorSpec,
        description="Accelerator per replica.",
        json_schema_extra=OBJECT_DEFAULT,
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        description="Where the replicas run.",
        json_schema_extra=OBJECT_DEFAULT,
    )
    prewarm: PrewarmSpec = Field(
        default_factory=PrewarmSpec,
        description="Model prewarming.",
        json_schema_extra=OBJECT_DEFAULT,
    )
    thermal: ThermalSpec = Field(
        default_factory=ThermalSpec,
        description="Thermal control.",
        json_schema_extra=OBJECT_DEFAULT,
    )
    server: ServerSpec = Field(
        default_factory=ServerSpec, description="HTTP server.", json_schema_extra=OBJECT_DEFAULT
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Runtime container resources; by default sized from the model so pods are "
        "neither OOM-killed nor starved.",
    )
    image: str | None = Field(
        default=None, max_length=1024, description="Runtime image; default from the operator."
    )
    rollout: RolloutSpec | None = Field(
        default=None,
        description="Roll spec changes out site by site, with health gates and rollback. "
        "With a rollout each site runs its own Deployment and spec.replicas is split "
        "evenly over the sites.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=64,
        description="LoRA adapters served on the loaded base model, each under its own model "
        "name, applied per request. Adding or removing one restarts nothing.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    scaling: ScalingSpec | None = Field(
        default=None,
        description="Scale with demand, to zero if minReplicas is 0 (the site gateway drives "
        "spec.replicas through the scale subresource, within minReplicas..maxReplicas).",
    )
    sampling: SamplingSpec | None = Field(
        default=None,
        description="What a request's left-out sampling fields mean on this deployment, e.g. "
        "llama-server's defaults (temperature 0.8, topP 0.95, topK 40, minP 0.05). Unset: "
        "OpenAI's (temperature 1, nothing filtered).",
    )

    def desired_replicas(self) -> int:
        """The replicas to run: spec.replicas, held within scaling's bounds when it has them
        (the gateway writes spec.replicas; a hand-written value outside them is clamped, not
        refused, so `kubectl scale` never fails on a scaled object)."""
        if self.scaling is None:
            return self.replicas
        return min(max(self.replicas, self.scaling.min_replicas), self.scaling.max_replicas)


# ----------------------------------------------------------------------------- status


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(CrdModel):
    type: str = Field(
        description="Ready, Progressing, Degraded, Throttled, AdaptersReady, Reconciling or "
        "Stalled."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None,
        description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, description="The .metadata.generation the condition was computed for."
    )


class ReplicaStatus(CrdModel):
    pod: str = Field(description="Pod name.")
    node: str | None = Field(default=None, description="Node the pod runs on.")
    phase: str | None = Field(default=None, description="Pod phase.")
    temperature_celsius: float | None = Field(
        default=None, description="Last accelerator temperature (thermal control fills it)."
    )
    max_batch_size: int | None = Field(
        default=None, description="Batch size currently allowed (thermal control fills it)."
    )
    joules_per_token: float | None = Field(
        default=None,
        ge=0,
        description="Energy per output token over the replica's last minute (J), from its power "
        "sensor (NVML, npu-smi, hwmon, RAPL); absent without a sensor or without tokens.",
    )


class SiteHealth(CrdModel):
    requests: int = Field(default=0, description="Requests finished in the replicas' windows.")
    errors: int = Field(default=0, description="Of those, server errors.")
    ttft_p99_ms: int | None = Field(default=None, description="Worst replica's TTFT p99 (ms).")


class SiteRollout(CrdModel):
    name: str = Field(description="The site.")
    wave: str = Field(description="The wave it belongs to.")
    revision: str | None = Field(default=None, description="The revision its pods run.")
    phase: str = Field(
        description="Pending, Staging, Updating, Baking, Passed, Failed, Unreachable, Skipped "
        "or RolledBack."
    )
    reason: str | None = Field(default=None, description="Why, in one CamelCase word.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    since: str | None = Field(default=None, description="When the phase began (RFC 3339).")
    unreachable_since: str | None = Field(
        default=None, description="Since when none of the site's nodes is Ready (RFC 3339)."
    )
    baseline: SiteHealth | None = Field(
        default=None, description="The previous version's figures on this site."
    )
    observed: SiteHealth | None = Field(
        default=None, description="The new version's figures on this site."
    )


class WaveRollout(CrdModel):
    name: str = Field(description="Wave name.")
    phase: str = Field(description="Pending, Progressing, Passed, Failed or RolledBack.")
    sites: int = Field(default=0, description="Sites in the wave.")
    passed: int = Field(default=0, description="Sites that passed the gate.")
    started_at: str | None = Field(default=None, description="When it started (RFC 3339).")
    finished_at: str | None = Field(default=None, description="When it ended (RFC 3339).")


class RolloutStatus(CrdModel):
    phase: str = Field(
        description="Complete, Progressing, Paused, Halted (a gate failed or a site is "
        "unreachable) or RolledBack."
    )
    summary: str | None = Field(default=None, description="One line, for kubectl get.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    stable_revision: str | None = Field(default=None, description="The previous version.")
    update_revision: str | None = Field(default=None, description="The version rolling out.")
    stable_spec: (
        Annotated[
            dict[str, Any],
            WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
        ]
        | None
    ) = Field(
        default=None,
        description="The previous version's spec: what a rollback goes back to (the node "
        "agents keep its model's files while the rollout runs).",
    )
    current_wave: str | None = Field(default=None, description="The wave in progress.")
    waves: list[WaveRollout] = Field(default_factory=list, description="Per wave.")
    sites: list[SiteRollout] = Field(default_factory=list, description="Per site.")


class InferenceDeploymentStatus(CrdModel):
    observed_generation: int | None = Field(default=None, description="Last generation handled.")
    replicas: int = Field(default=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, description="Pods that are ready.")
    ready: str | None = Field(default=None, description="ready/desired, for kubectl get.")
    reason: str | None = Field(default=None, description="Short status reason, for kubectl get.")
    selector: str | None = Field(default=None, description="Label selector of the pods (scale).")
    hottest_celsius: int | None = Field(
        default=None, description="Hottest replica's temperature (°C, whole degrees)."
    )
    max_batch_size: int | None = Field(
        default=None,
        description="Smallest batch size currently allowed across replicas (thermal control).",
    )
    joules_per_token: float | None = Field(
        default=None,
        ge=0,
        description="Energy per output token (J): the mean of the replicas that report it.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, Throttled.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replica_statuses: list[ReplicaStatus] = Field(
        default_factory=list, description="Per-pod state."
    )
    rollout: RolloutStatus | None = Field(
        default=None, description="The site-by-site rollout (spec.rollout)."
    )


def parse_spec(spec: Any) -> InferenceDeploymentSpec:
    """Parse a spec as received from the API server (already defaulted and validated there)."""
    return InferenceDeploymentSpec.model_validate(dict(spec))
