"""How much memory the llama.cpp engine allocates: one rule for the operator and the runtime.

Both sides call `replica_memory` on the one `RuntimeConfig` the ConfigMap carries: the operator
sizes the pod with it (`ember_operator.sizing`, on the config it is about to write) and the
runtime checks, before it loads anything, that the same figure fits under its container's
cgroup limit (`check_limit`, on the config it read), refusing to start with a one-line reason
rather than being OOM-killed later. The engine's modes and their defaults (step tokens, KV
layout, offloaded layers) are the contract's (`contract/config.py`).

* KV cache: the engine gives every sequence its own KV stream of `contextLength` cells, so it
  allocates `contextLength x maxBatchSize` cells (`kv_cells`): layers x cells x KV heads x
  (key + value head size) x 2 bytes (f16). Gemma 3's sliding-window layers are allocated at
  full size too (llama.cpp does so when several sequences share a context: "full-size SWA
  cache" in its log). The prefix cache lives in these same cells, so it adds nothing.
* Output and compute buffers: logits for one row per sequence, and one micro-batch of
  `batch_tokens` rows (a step's prompt tokens plus a decode row per sequence): the attention
  mask over the cells a row may attend (the whole pool when it is unified) and activations.
  llama.cpp's flash attention (its `auto` choice on the CPU and CUDA) never materialises the
  per-head scores; the mask is what grows with the pool.
* Weights: mmapped. From the memory-backed prewarm volume they are charged to the pod (tmpfs
  pages written by the init container), not to the runtime container's cgroup; without
  prewarm the page cache of the mapped file is charged to the container that reads it.
* A fixed runtime overhead (Python, the server, llama.cpp's own allocations).

On a GPU (`n_gpu_layers` > 0, `offloaded_layers`) each offloaded layer's weights and KV cells
live in device memory, and so does the compute graph; the logits (output buffer) stay in host
memory. The split is by layer count (`Offload`): exact for the KV cache, an estimate for the
weights (llama.cpp keeps the token embeddings in host memory, where they are a mmapped,
reclaimable page cache; counted on the device side here). The host figure is what the pod's
memory limit must hold; the device figure is reported beside it, not enforced (the device
plugin hands out whole GPUs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from ember_runtime.contract.config import (
    ALL_LAYERS,
    DEFAULT_STEP_TOKENS,
    DRAFT_BATCH_TOKENS,
    UNIFIED_BY_DEFAULT,
    RuntimeConfig,
)
from ember_runtime.gguf_header import LongArray, read_header

F16_BYTES = 2
F32_BYTES = 4
MIB = 1 << 20
RUNTIME_OVERHEAD_BYTES = 192 * MIB  # measured RSS of the idle server besides the model


@dataclass(frozen=True)
class Offload:
    """Which share of the per-layer bytes (weights, KV cache) sits in host and device memory."""

    host: float
    device: float

    @classmethod
    def of(cls, offloaded: int, layers: int | None) -> Offload:
        """`offloaded` of `layers` layers on the device. With no header (`layers` None) both
        sides take the upper bound: all on the host unless every layer is offloaded, and all
        on the device once any is."""
        if offloaded <= 0:
            return cls(host=1.0, device=0.0)
        if layers is None:
            return cls(host=0.0 if offloaded >= ALL_LAYERS else 1.0, device=1.0)
        on_device = min(offloaded, layers) / layers
        return cls(host=1.0 - on_device, device=on_device)

    def split(self, total: int) -> tuple[int, int]:
        """(host bytes, device bytes) of `total` per-layer bytes, rounded up on both sides."""
        return math.ceil(total * self.host), math.ceil(total * self.device)


CPU_ONLY = Offload(host=1.0, device=0.0)


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


@functools.lru_cache(maxsize=64)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFShape:
    # A streaming read of the key/value header only (gguf_header explains why not GGUFReader).
    fields = read_header(Path(path))
    arch = str(fields.get("general.architecture", ""))

    def num(key: str, default: int | None = None) -> int:
        value = fields.get(f"{arch}.{key}")
        if value is None or isinstance(value, (str, LongArray)):
            if default is None:
                raise ValueError(f"{path}: GGUF header lacks {arch}.{key}")
            return default
        return int(value[0] if isinstance(value, list) else value)

    embedding = num("embedding_length")
    heads = num("attention.head_count")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = tokens.length if isinstance(tokens, LongArray) else num("vocab_size")
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


def output_buffer_bytes(shape: GGUFShape, outputs: int) -> int:
    """The logits llama.cpp hands back: host memory whether or not layers are offloaded. At
    most `outputs` rows: the engine sets `n_outputs_max` to one per sequence; without that
    limit llama.cpp would size logits for every row (~514 MiB at a 512-row micro-batch)."""
    return shape.vocab * outputs * F32_BYTES


def graph_buffer_bytes(shape: GGUFShape, attended: int, ubatch: int, outputs: int) -> int:
    """The compute graph's buffer (in device memory once layers are offloaded): the output
    layer's logits, then per micro-batch row a mask entry for every cell it may attend and
    its activations (~11 embedding-wide f32 vectors measured; 12 counted).

    An upper bound of what llama.cpp reports for Gemma 3 270M at 2048 x 16 (output 16 MiB;
    compute, measured / this rule): per-sequence streams 17.1 / 26.1 MiB at 256 prompt tokens
    per step, 44.2 / 54.6 at 1024; one pool 43.4 / 58.0 at 256, 166.1 / 176.5 at 1024; and
    at 512 x 16 in one pool at 1024, 68.6 / 79.0."""
    per_row = attended * F32_BYTES + shape.embedding * F32_BYTES * 12
    return output_buffer_bytes(shape, outputs) + ubatch * per_row


@dataclass(frozen=True)
class EngineMemory:
    """Bytes the engine allocates besides the weights: `kv_cache`, `compute_buffer` and
    `overhead` in host memory (what the container's limit must hold), `device_*` in device
    memory (zero on the CPU)."""

    kv_cache: int
    compute_buffer: int
    overhead: int
    device_kv_cache: int = 0
    device_compute_buffer: int = 0

    @property
    def total(self) -> int:
        """Host memory."""
        return self.kv_cache + self.compute_buffer + self.overhead

    @property
    def device(self) -> int:
        return self.device_kv_cache + self.device_compute_buffer


def engine_memory(
    shape: GGUFShape,
    *,
    context: int,
    sequences: int,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    overhead: int = RUNTIME_OVERHEAD_BYTES,
    unified: bool = UNIFIED_BY_DEFAULT,
    offload: Offload = CPU_ONLY,
    draft_rows: int = 0,
) -> EngineMemory:
    """What the llama.cpp engine allocates besides the weights (see the module docstring).

    `draft_rows`: rows a step may add for speculative drafts, each with its logits.

    `unified`: one KV pool for all sequences (the same cells in total), whose attention spans
    the whole pool rather than one sequence's stream. `offload`: the layers' share in device
    memory; the graph buffer goes there with any offloaded layer, and stays on the host too
    while some layers run on the CPU."""
    cells = kv_cells(context, sequences)
    host_kv, device_kv = offload.split(kv_cache_bytes(shape, cells))
    attended = cells if unified else context
    outputs = sequences + draft_rows
    ubatch = batch_tokens(step_tokens, sequences) + draft_rows
    graph = graph_buffer_bytes(shape, attended, ubatch, outputs)
    return EngineMemory(
        kv_cache=host_kv,
        compute_buffer=output_buffer_bytes(shape, outputs) + (graph if offload.host else 0),
        overhead=overhead,
        device_kv_cache=device_kv,
        device_compute_buffer=graph if offload.device else 0,
    )


def embedding_memory(
    shape: GGUFShape,
    *,
    context: int,
    overhead: int = RUNTIME_OVERHEAD_BYTES,
    offload: Offload = CPU_ONLY,
) -> EngineMemory:
    """What the embedding engine (engines/embedding) allocates besides the weights: one pool
    of `context` cells, and a micro-batch of `context` rows of which every one is an output
    (llama.cpp's embedding mode), so a decoder model's output layer is sized for all of them,
    in the output buffer and in the graph. Measured on Gemma 3 270M, CPU (resident growth
    after a full-length input / this rule): 1,001 / 1,049 MiB at 512, 4,093 / 4,208 at 2048.
    An encoder (BERT) has no output layer: an overestimate there."""
    host_kv, device_kv = offload.split(kv_cache_bytes(shape, context))
    graph = graph_buffer_bytes(shape, context, context, context)
    return EngineMemory(
        kv_cache=host_kv,
        compute_buffer=output_buffer_bytes(shape, context) + (graph if offload.host else 0),
        overhead=overhead,
        device_kv_cache=device_kv,
        device_compute_buffer=graph if offload.device else 0,
    )


def offload_for(config: RuntimeConfig, layers: int | None) -> Offload:
    """How the engine `config` starts splits a model of `layers` layers (None: not known)."""
    return Offload.of(config.engine.offloaded_layers(config.accelerator), layers)


def replica_memory(
    config: RuntimeConfig,
    shape: GGUFShape,
    overhead: int = RUNTIME_OVERHEAD_BYTES,
    draft: GGUFShape | None = None,
) -> EngineMemory:
    """What the engine `config` starts allocates besides the weights: the figure the operator
    sizes the pod with and the runtime checks its cgroup limit against, both from the one
    config the ConfigMap carries (context, batch, step, KV layout, offload, task). `draft`:
    the draft model's shape (`engine.speculation.draftModel`), whose context adds its own KV
    cells for every sequence and a batch of `DRAFT_BATCH_TOKENS` rows (engines/draft.py)."""
    engine, offload = config.engine, offload_for(config, shape.layers)
    if config.task == "embed":
        return embedding_memory(
            shape, context=engine.context_length, overhead=overhead, offload=offload
        )
    need = engine_memory(
        shape,
        context=engine.context_length,
        sequences=engine.max_batch_size,
        step_tokens=engine.step_tokens,
        overhead=overhead,
        unified=engine.llamacpp_modes().kv_unified,
        offload=offload,
        draft_rows=engine.draft_rows(),
    )
    if draft is None or config.draft_file() is None:
        return need
    drafting = engine_memory(
        draft,
        context=engine.context_length,
        sequences=engine.max_batch_size,
        step_tokens=DRAFT_BATCH_TOKENS - engine.max_batch_size,
        overhead=0,
        unified=True,
        offload=offload_for(config, draft.layers),
    )
    return EngineMemory(
        kv_cache=need.kv_cache + drafting.kv_cache,
        compute_buffer=need.compute_buffer + drafting.compute_buffer,
        overhead=need.overhead,
        device_kv_cache=need.device_kv_cache + drafting.device_kv_cache,
        device_compute_buffer=need.device_compute_buffer + drafting.device_compute_buffer,
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


def _mib(n: int) -> int:
    return -(-n // MIB)
