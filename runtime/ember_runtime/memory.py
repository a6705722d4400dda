"""How much memory the llama.cpp engine allocates: one rule for the operator and the runtime.

The operator sizes the pod with these functions (`ember_operator.sizing`) and the runtime
checks, before it loads anything, that the same figure fits under its container's cgroup limit
(`check_limit`), refusing to start with a one-line reason rather than being OOM-killed later.

* KV cache: the engine gives every sequence its own KV stream of `contextLength` cells, so it
  allocates `contextLength x maxBatchSize` cells (`kv_cells`): layers x cells x KV heads x
  (key + value head size) x 2 bytes (f16). Gemma 3's sliding-window layers are allocated at
  full size too (llama.cpp does so when several sequences share a context: "full-size SWA
  cache" in its log). The prefix cache lives in these same cells, so it adds nothing.
* Output and compute buffers: logits for one row per sequence, and one micro-batch of
  `batch_tokens` rows (a step's prompt tokens plus a decode row per sequence): attention
  scores and activations.
* Weights: mmapped. From the memory-backed prewarm volume they are charged to the pod (tmpfs
  pages written by the init container), not to the runtime container's cgroup; without
  prewarm the page cache of the mapped file is charged to the container that reads it.
* A fixed runtime overhead (Python, the server, llama.cpp's own allocations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember_runtime.config import RuntimeConfig

F16_BYTES = 2
F32_BYTES = 4
MIB = 1 << 20
RUNTIME_OVERHEAD_BYTES = 192 * MIB  # measured RSS of the idle server besides the model
DEFAULT_STEP_TOKENS = 256
# Fast mode keeps all sequences in one KV pool (llama-server's -kvu); deterministic mode never.
UNIFIED_BY_DEFAULT = False


def unified_kv(deterministic: bool, setting: bool | None = None) -> bool:
    """The KV layout the engine uses: one pool, or one stream per sequence."""
    if deterministic:
        return False
    return UNIFIED_BY_DEFAULT if setting is None else setting


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


def kv_cells(context: int, sequences: int) -> int:
    """The engine's `n_ctx`: one KV stream of `context` cells per sequence."""
    return context * sequences


def batch_tokens(step_tokens: int, sequences: int) -> int:
    """The engine's `n_batch` = `n_ubatch`: every decode row plus a step's prompt tokens."""
    return step_tokens + sequences


def kv_cache_bytes(shape: GGUFShape, cells: int) -> int:
    return (
        shape.layers * cells * shape.kv_heads * (shape.key_length + shape.value_length) * F16_BYTES
    )


def compute_buffer_bytes(shape: GGUFShape, attended: int, ubatch: int, outputs: int) -> int:
    """The output buffer (logits of at most `outputs` rows: the engine sets `n_outputs_max` to
    one per sequence) plus the graph's compute buffer: those logits again, then per row of
    the micro-batch the attention scores over the `attended` KV cells and the activations.

    An upper bound of what llama.cpp reports for Gemma 3 270M (measured: 16 + 17.1 MiB at
    2048 x 16, 4 + 9.5 MiB at 512 x 4; this gives 46 and 15 MiB). Without the output limit
    llama.cpp would size logits for every row: ~514 MiB at a 512-row micro-batch.
    """
    logits = shape.vocab * outputs * F32_BYTES
    per_row = shape.heads * attended * F32_BYTES + shape.embedding * F32_BYTES * 8
    return 2 * logits + ubatch * per_row


@dataclass(frozen=True)
class EngineMemory:
    kv_cache: int
    compute_buffer: int
    overhead: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.compute_buffer + self.overhead


def engine_memory(
    shape: GGUFShape,
    *,
    context: int,
    sequences: int,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    overhead: int = RUNTIME_OVERHEAD_BYTES,
    unified: bool = False,
) -> EngineMemory:
    """What the llama.cpp engine allocates besides the weights (see the module docstring).

    `unified`: one KV pool for all sequences (the same cells in total), whose attention spans
    the whole pool rather than one sequence's stream."""
    cells = kv_cells(context, sequences)
    return EngineMemory(
        kv_cache=kv_cache_bytes(shape, cells),
        compute_buffer=compute_buffer_bytes(
            shape, cells if unified else context, batch_tokens(step_tokens, sequences), sequences
        ),
        overhead=overhead,
    )


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes (cgroup v2, else v1); None when unlimited."""
    v2 = root / "memory.max"
    if v2.is_file():
        raw = v2.read_text().strip()
        return None if raw == "max" else int(raw)
    v1 = root / "memory" / "memory.limit_in_bytes"
    if v1.is_file():
        value = int(v1.read_text().strip())
        return None if value >= 1 << 60 else value  # v1 says "unlimited" with a huge number
    return None


class MemoryLimitError(RuntimeError):
    """The engine's memory need exceeds the container's limit (one line, for the pod status)."""


def check_limit(need: EngineMemory, weights: int, limit: int | None) -> None:
    """Raise MemoryLimitError when `need` plus `weights` (charged to this container) exceeds
    `limit`."""
    total = need.total + weights
    if limit is None or total <= limit:
        return
    raise MemoryLimitError(
        f"memory: needs {_mib(total)} MiB (KV cache {_mib(need.kv_cache)}, compute "
        f"{_mib(need.compute_buffer)}, weights {_mib(weights)}, runtime {_mib(need.overhead)}) "
        f"but the container limit is {_mib(limit)} MiB; lower engine.maxBatchSize or "
        "engine.contextLength, or raise the memory limit"
    )


def preflight(config: RuntimeConfig, model: Path, cgroup_root: Path) -> EngineMemory | None:
    """Before loading anything: refuse to start when the engine cannot fit in this container.

    Only for GGUF models on the llama.cpp engine (None otherwise). Weights served from the
    prewarm volume are charged to the pod, not to this container, so they do not count here.
    """
    if config.engine.kind != "llamacpp" or model.suffix != ".gguf":
        return None
    modes = config.engine.llamacpp_modes()
    need = engine_memory(
        read_gguf_shape(model),
        context=config.engine.context_length,
        sequences=config.engine.max_batch_size,
        step_tokens=config.engine.step_tokens,
        unified=modes.kv_unified,
    )
    prewarmed = config.prewarm_dir is not None and model.is_relative_to(config.prewarm_dir)
    check_limit(need, 0 if prewarmed else model.stat().st_size, cgroup_memory_limit(cgroup_root))
    return need


def _mib(n: int) -> int:
    return -(-n // MIB)
