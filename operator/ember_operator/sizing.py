"""Size a replica from its model so pods are neither OOM-killed nor starved.

OOM kills are the top field failure, so when a spec gives no `resources` the runtime container's
memory is derived from what the engine will actually allocate:

* the weights: the files themselves, which live in the memory-backed prewarm volume (tmpfs pages
  are charged to the pod) or, without prewarm, in the page cache of the mmapped hostPath files;
* the KV cache: layers x context x KV heads x (key + value head size) x 2 bytes (f16);
* the compute buffer: dominated by the logits, vocab x micro-batch x 4 bytes. Gemma 3 270M
  has a 262k vocabulary, which made its compute buffer ~514 MiB at a 512-token batch (measured),
  far more than its 250 MB of weights;
* a fixed runtime overhead (Python, the server, the engine's own allocations).

The GGUF header (read with `gguf.GGUFReader`, memory-mapped, no weights loaded) gives the exact
shape; without a readable header the figures are a stated, conservative estimate.
Threads follow the CPU limit, never above it: 2 threads on 2 busy cores measured 0.38x of 1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from ember_operator import quantity
from ember_operator.api.models import InferenceDeploymentSpec, ModelFormat
from ember_operator.settings import OperatorSettings

F16_BYTES = 2
F32_BYTES = 4
DEFAULT_UBATCH = 512
SHM_SLACK_BYTES = 64 * quantity.MIB
STARTUP_PERIOD_SECONDS = 5


@dataclass(frozen=True)
class GGUFShape:
    """The parts of a GGUF header that decide how much memory inference needs."""

    architecture: str
    layers: int
    embedding: int
    vocab: int
    context: int
    heads: int
    kv_heads: int
    key_length: int
    value_length: int


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@functools.lru_cache(maxsize=64)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFShape:
    # Lazy: gguf pulls in numpy (~25 MB RSS), needed only when a header is actually readable.
    from gguf import GGUFReader  # noqa: PLC0415

    reader = GGUFReader(path, "r")
    arch = str(_field(reader, "general.architecture"))

    def num(key: str, default: int | None = None) -> int:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{path}: GGUF header lacks {arch}.{key}")
            return default
        return int(value[0] if isinstance(value, list) else value)

    embedding = num("embedding_length")
    heads = num("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else num("vocab_size")
    return GGUFShape(
        architecture=arch,
        layers=num("block_count"),
        embedding=embedding,
        vocab=vocab,
        context=num("context_length"),
        heads=heads,
        kv_heads=num("attention.head_count_kv", heads),
        key_length=num("attention.key_length", embedding // heads),
        value_length=num("attention.value_length", embedding // heads),
    )


def read_gguf_shape(path: Path) -> GGUFShape:
    """Read a GGUF header (cached by path, size and mtime: headers don't change in place)."""
    st = path.stat()
    return _read_cached(str(path), st.st_size, st.st_mtime_ns)


def find_gguf_shape(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> GGUFShape | None:
    """Find the model's GGUF file where this operator can read it, else None (estimate)."""
    if spec.model.format != ModelFormat.GGUF:
        return None
    roots = list(settings.model_roots)
    if spec.model.source.host_path is not None:
        roots.insert(0, Path(spec.model.source.host_path.path))
    for file in spec.model.files:
        if not file.path.endswith(".gguf"):
            continue
        for root in roots:
            candidate = root / file.path
            try:
                if candidate.is_file() and candidate.stat().st_size == file.size_bytes:
                    return read_gguf_shape(candidate)
            except (OSError, ValueError):
                continue
    return None


@dataclass(frozen=True)
class Sizing:
    """Every computed figure, shown verbatim in the rendered ConfigMap."""

    source: str  # "gguf-header" | "estimate" | "user"
    model_bytes: int
    shared_memory_bytes: int
    kv_cache_bytes: int
    compute_buffer_bytes: int
    overhead_bytes: int
    memory_bytes: int
    cpu: str
    threads: int
    startup_period_seconds: int
    startup_failure_threshold: int
    shape: GGUFShape | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory"] = quantity.format_bytes(self.memory_bytes)
        data["sharedMemory"] = quantity.format_bytes(self.shared_memory_bytes)
        return data


def kv_cache_bytes(shape: GGUFShape, context: int) -> int:
    return (
        shape.layers
        * context
        * shape.kv_heads
        * (shape.key_length + shape.value_length)
        * (F16_BYTES)
    )


def compute_buffer_bytes(shape: GGUFShape, context: int, ubatch: int) -> int:
    """Logits (vocab x batch, f32) or attention scores, whichever is larger, plus activations."""
    logits = shape.vocab * ubatch * F32_BYTES
    scores = shape.heads * context * ubatch * F32_BYTES
    activations = shape.embedding * ubatch * F32_BYTES * 4
    return max(logits, scores) + activations


def _estimate(model_bytes: int, context: int) -> tuple[int, int]:
    """No header: assume a 7B-class KV footprint scaled by size and a 262k-vocab compute buffer."""
    per_token = max(32 * 1024, int(512 * 1024 * min(1.0, model_bytes / 4e9)))
    return per_token * context, 512 * quantity.MIB + 16 * quantity.MIB


def _ubatch(spec: InferenceDeploymentSpec) -> int:
    for key in ("n_ubatch", "n_batch"):
        raw = spec.engine.args.get(key)
        if raw is not None and raw.isdigit() and int(raw) > 0:
            return min(int(raw), spec.engine.context_length)
    return min(DEFAULT_UBATCH, spec.engine.context_length)


def shared_memory_bytes(spec: InferenceDeploymentSpec) -> int:
    """The memory-backed volume's size: the spec's limit or the files plus slack."""
    if not spec.prewarm.enabled:
        return 0
    if spec.prewarm.shared_memory_limit is not None:
        return int(quantity.parse(spec.prewarm.shared_memory_limit))
    return quantity.ceil_mib(model_bytes(spec) + SHM_SLACK_BYTES)


def model_bytes(spec: InferenceDeploymentSpec) -> int:
    return sum(f.size_bytes for f in spec.model.files)


def cpu_for(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> Fraction:
    res = spec.resources
    if res is not None:
        for table in (res.limits, res.requests):
            if "cpu" in table:
                return quantity.parse(table["cpu"])
    return quantity.parse(settings.default_cpu)


def compute(
    spec: InferenceDeploymentSpec, settings: OperatorSettings, shape: GGUFShape | None
) -> Sizing:
    """Pure: the sizing of one replica from its spec and (when readable) its GGUF header."""
    total = model_bytes(spec)
    shm = shared_memory_bytes(spec)
    context = spec.engine.context_length
    if shape is not None:
        kv, buf = (
            kv_cache_bytes(shape, context),
            compute_buffer_bytes(shape, context, _ubatch(spec)),
        )
    else:
        kv, buf = _estimate(total, context)
    overhead = settings.runtime_overhead_mib * quantity.MIB
    weights = shm if spec.prewarm.enabled else total  # page cache of the mmapped files
    memory = quantity.ceil_mib(int((weights + kv + buf + overhead) * settings.memory_headroom))
    cpu = cpu_for(spec, settings)
    threads = spec.engine.threads or max(1, math.floor(cpu))
    load_seconds = total / (settings.min_load_bandwidth_mib_s * quantity.MIB)
    failures = math.ceil((settings.startup_base_seconds + load_seconds) / STARTUP_PERIOD_SECONDS)
    source = (
        "user"
        if spec.resources is not None
        else ("gguf-header" if shape is not None else "estimate")
    )
    return Sizing(
        source=source,
        model_bytes=total,
        shared_memory_bytes=shm,
        kv_cache_bytes=kv,
        compute_buffer_bytes=buf,
        overhead_bytes=overhead,
        memory_bytes=memory,
        cpu=quantity.format_cpu(cpu),
        threads=threads,
        startup_period_seconds=STARTUP_PERIOD_SECONDS,
        startup_failure_threshold=max(3, failures),
        shape=shape,
    )
