"""Continuous batching over llama.cpp's low-level API (llama-cpp-python's ctypes bindings).

One context holds `capacity` sequences, each with its own `seq_id`, in one KV pool of
`contextLength x capacity` cells (fast mode) or one KV stream per sequence (deterministic).
A single thread loads the model and runs the decode loop (see `_main` for why one); what goes
into each step is decided by the policy in `engines/scheduler.py` (no model needed to read or
test it), this module only binds it to llama.cpp: it fills the batch, calls `llama_decode`,
samples, and hands one step's deltas to the event loop in one `call_soon_threadsafe`. ctypes
releases the GIL during `llama_decode`, so the event loop keeps serving while it runs.

Two modes (measured on this project's 2-core x86 box with Gemma 3 270M Q4_K_M;
`bench/results/runtime_bench.md` has the numbers):

* **Fast (default)**, as llama-server: one `llama_decode` per step over every decoding
  sequence and up to `step_tokens` tokens of waiting prompts, llama.cpp's repacked (AVX2)
  weights where the CPU has them, and the prefix cache on. Output is deterministic for a given
  arrival pattern but not batch-independent: llama.cpp's CPU kernels change with the number of
  rows in a call (8+ rows differ from 1 by up to ~1.0 in the logits on that box), so a greedy
  reply can differ by which requests it shared steps with.
* **Deterministic** (`engine.deterministic: true`): a request's greedy output is the same alone
  or batched. Decode rows go in calls no wider than the widest that a probe at load found
  bit-identical to single rows *on this CPU* (`_probe_rows`: 7 on the box above; another CPU
  may switch kernels elsewhere or never), each prompt chunk gets its own call cut at fixed
  positions, and repacking and the prefix cache are off (both change kernel shapes). The cost:
  an extra pass over the weights per step from the (exact_rows + 1)th sequence on, one prompt
  chunk per step, no prompt reuse.

KV layout. Fast mode puts every sequence in one pool (`kv_unified`, as llama-server's `-kvu`;
runtime config `engine.kvUnified` can turn it off): any step is one micro-batch whatever its
mix of decode rows and prompt chunks, and a new request shares a running one's computed prompt
cells (`_share_live_prefix`). Deterministic mode gives every sequence its own stream, so
attention never spans another sequence's (masked) cells; llama.cpp then cuts a batch into
micro-batches of consecutive seq_ids taking the same number of tokens from each
(`split_equal`), each a full pass over the weights, so running sequences are kept on seq_ids
0..n-1 (`_compact`; this changes no numbers). Not covered: a single sequence past 256 tokens
of context alone may take llama.cpp's split-KV attention path, which a batched one does not
(not measured).

The prefix cache: a finished request's prompt stays in its seq_id's KV cells, and a new request
takes the free seq_id whose cached prompt shares the longest prefix with its own (a chat system
prompt, few-shot examples), decoding only the rest. It costs no memory (the pool holds
`contextLength x maxBatchSize` cells anyway) and is bounded by the number of sequences; an
entry is evicted only when its seq_id is needed by a request that shares nothing longer with
any other free seq_id — so the most useful prefixes survive. In the pool a running sequence's
prompt is shared too (a copy only tags cells with one more seq_id), so a burst with a new
shared system prompt computes it once per step it arrives in; with per-sequence streams
(deterministic mode has the prefix cache off) a copy would move the whole stream buffer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ember_runtime.contract.config import DEFAULT_STEP_TOKENS, unified_kv
from ember_runtime.engines import device_sampling, sampling
from ember_runtime.engines.base import (
    ChatMessage,
    Delta,
    EngineError,
    EngineInfo,
    EngineState,
    EngineStoppingError,
    EngineUnavailableError,
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    StepObserver,
    StepStats,
    TokenLogprob,
    TopLogprob,
)
from ember_runtime.engines.chat import render_template
from ember_runtime.engines.device_sampling import DeviceChain, DeviceSampling
from ember_runtime.engines.scheduler import (
    Call,
    Policy,
    admissible,
    plan_step,
    queued,
    split_active,
)
from ember_runtime.engines.text import TextAssembler
from ember_runtime.engines.tools import OPEN, builtin_messages, tools_in_messages

log = logging.getLogger(__name__)

# Deterministic mode: the most rows a `llama_decode` may carry is probed at start (`_probe_rows`),
# never assumed: the width at which llama.cpp switches CPU kernels depends on the CPU and the
# build (measured on one 2-core x86 box: logits differ by up to ~1.0 from 8 rows on,
# bit-identical for 2..7; another CPU may switch earlier or never). The probe tries widths up
# to this bound; past it a pass over the weights is compute-bound anyway on a small edge CPU.
_PROBE_MAX_ROWS = 16
_PROBE_PREFIX = 3  # tokens of context per probe sequence, so attention has cells to read
# Rows are drawn on a pool only where this many cores are spare; at most this many threads.
_MIN_SAMPLER_THREADS = 2
_MAX_SAMPLER_THREADS = 8
# llama.cpp logs every tensor at load time; keep warnings and errors only. The callback must
# outlive the library, hence a module-level reference.
_GGML_LEVELS = {3: logging.WARNING, 4: logging.ERROR}  # ggml: 1 debug, 2 info, 3 warn, 4 error
_log_callback: Any = None


def _install_log_callback(llama: Any) -> None:
    global _log_callback  # noqa: PLW0603 - one process-wide C callback, set once
    if _log_callback is not None:
        return
    native = logging.getLogger("llama.cpp")

    def forward(level: int, text: bytes, _user: Any) -> None:
        py_level = _GGML_LEVELS.get(level)
        if py_level is not None:
            native.log(py_level, text.decode("utf-8", "replace").rstrip())

    _log_callback = llama.llama_log_callback(forward)
    llama.llama_log_set(_log_callback, ctypes.c_void_p(0))


def load_model(path: Path, *, gpu_layers: int, repack: bool) -> tuple[Any, Any]:
    """The llama_cpp module and the model at `path` (memory-mapped, `gpu_layers` offloaded);
    raises EngineUnavailableError with the reason. Shared by the generation and embedding
    engines (engines/embedding.py)."""
    try:
        import llama_cpp as ll  # noqa: PLC0415 - heavy; loaded when the engine starts
    except ImportError as exc:  # pragma: no cover - the runtime extra pins it
        raise EngineUnavailableError(f"llama-cpp-python is not installed: {exc}") from exc
    if not path.is_file():
        raise EngineUnavailableError(f"model file not found: {path}")
    _install_log_callback(ll)
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    mparams.load_mode = ll.LLAMA_LOAD_MODE_MMAP  # share pages with prewarm's copy
    mparams.n_gpu_layers = gpu_layers
    if gpu_layers and not ll.llama_supports_gpu_offload():
        # A CPU-only build asked to offload (the CPU image on a GPU node): serve anyway,
        # slowly, and say why in the log rather than refuse.
        log.warning("gpu_layers=%d but this llama.cpp has no GPU backend", gpu_layers)
    # Repacked weights (AVX2 gemm on 4/8 columns, gemv for the rest) are faster and round
    # differently for one token than for several: off in deterministic mode. Where the CPU
    # has no repacked kernels llama.cpp keeps the plain layout.
    mparams.use_extra_bufts = repack
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise EngineUnavailableError(f"llama.cpp could not load {path}")
    return ll, model


def free_native(ll: Any, batch: Any, ctx: Any, model: Any) -> None:
    """Free what load_model and a context made, batch first, model last (shared by both
    engines); None or NULL parts are skipped."""
    if batch is not None:
        ll.llama_batch_free(batch)
    if ctx:
        ll.llama_free(ctx)
    if model:
        ll.llama_model_free(model)


def tokenize(ll: Any, vocab: Any, text: str, *, add_special: bool) -> list[int]:
    """`text` as token ids of `vocab` (special tokens in the text are parsed as such)."""
    data = text.encode()
    buf = (ctypes.c_int32 * (len(data) + 8))()
    n = ll.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, True)
    if n < 0:
        buf = (ctypes.c_int32 * -n)()
        n = ll.llama_tokenize(vocab, data, len(data), buf, -n, add_special, True)
    return list(buf[:n])


class _Stream:
    """The event-loop side of one request: a queue of deltas and a cancel flag."""

    __slots__ = ("_engine", "_prompt_tokens", "_queue", "cancelled")

    def __init__(self, engine: LlamaCppEngine, prompt_tokens: int) -> None:
        self._engine = engine
        self._prompt_tokens = prompt_tokens
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._engine._wake()

    def put(self, delta: Delta) -> None:
        self._queue.put_nowait(delta)


class _Grammar:
    """llama.cpp's grammar sampler as a mask over a whole row, for the numpy sampler.

    The row goes into a `llama_token_data` array the size of the vocabulary (ids laid out
    once); llama.cpp sets the logit of every token the grammar forbids to -inf. Applied before
    any filter, so a top_k or top_p prefilter never drops a token the grammar allows.

    With `free_until` (a grammar that admits any text until that marker), checking the whole
    vocabulary every step would cost most of a step for nothing: until the marker appears,
    while no partial marker or UTF-8 sequence is open, only the `risky` tokens (those holding
    the marker's first character, or not UTF-8 on their own) can be refused, so only they are
    checked. Every other token is one the full check would allow too.
    """

    __slots__ = ("_arr", "_data", "_ll", "_piece", "_risky", "_smpl", "_sub", "_tail", "_until")

    def __init__(
        self,
        ll: Any,
        vocab: Any,
        n_vocab: int,
        text: str,
        *,
        free_until: bytes = b"",
        risky: Callable[[bytes], np.ndarray] | None = None,
        piece: Callable[[int], bytes] | None = None,
    ) -> None:
        smpl = ll.llama_sampler_init_grammar(vocab, text.encode(), b"root")
        if not smpl:
            raise InvalidRequestError(
                "llama.cpp could not compile the grammar for response_format",
                param="response_format",
            )
        self._ll, self._smpl = ll, smpl
        self._data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(n_vocab, dtype=np.int32)
        self._arr = self._array(self._data)
        lazy = bool(free_until) and risky is not None and piece is not None
        self._until, self._tail = free_until, (b"" if lazy else None)
        self._risky, self._piece = risky, piece
        self._sub: tuple[np.ndarray, Any] | None = None

    def _array(self, data: np.ndarray) -> Any:
        ll = self._ll
        return ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=len(data), selected=-1
        )

    def mask(self, row: np.ndarray) -> np.ndarray:
        if self._free():
            return self._mask_risky(row)
        self._data["logit"] = row
        self._apply(self._data, self._arr)
        out: np.ndarray = self._data["logit"].copy()
        return out

    def _apply(self, data: np.ndarray, arr: Any) -> None:
        arr.size, arr.selected, arr.sorted = len(data), -1, False
        self._ll.llama_sampler_apply(self._smpl, ctypes.byref(arr))

    def _mask_risky(self, row: np.ndarray) -> np.ndarray:
        if self._sub is None:
            assert self._risky is not None
            ids = self._risky(self._until[:1])
            sub = np.zeros(len(ids), dtype=_TOKEN_DATA)
            sub["id"] = ids
            self._sub = (sub, self._array(sub))
        sub, arr = self._sub
        sub["logit"] = row[sub["id"]]
        self._apply(sub, arr)
        out = row.copy()
        out[sub["id"]] = sub["logit"]
        return out

    def _free(self) -> bool:
        """Whether the text so far leaves the grammar in its free state (see above)."""
        tail = self._tail
        if tail is None or not _utf8_whole(tail):
            return False
        return not any(self._until.startswith(tail[-n:]) for n in range(1, len(tail) + 1))

    def accept(self, tok: int) -> None:
        self._ll.llama_sampler_accept(self._smpl, tok)
        if self._tail is not None:
            assert self._piece is not None
            tail = self._tail + self._piece(tok)
            keep = len(self._until) - 1
            self._tail = None if self._until in tail else tail[max(0, len(tail) - keep) :]

    def free(self) -> None:
        if self._smpl:
            self._ll.llama_sampler_free(self._smpl)
            self._smpl = None


def _utf8_whole(text: bytes) -> bool:
    """Whether `text` does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        if byte & 0xC0 != 0x80:  # the last lead byte: is its sequence complete?
            need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back >= need
    return True


# llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class _Sequence:
    """The decode-thread side of one request."""

    __slots__ = (
        "chain",
        "generated",
        "grammar",
        "last_token",
        "params",
        "prefilled",
        "prompt",
        "sampler",
        "seq_id",
        "stream",
        "text",
    )

    def __init__(
        self,
        stream: _Stream,
        prompt: list[int],
        params: SamplingParams,
        sampler: sampling.RowSampler,
        grammar: _Grammar | None,
    ) -> None:
        self.stream = stream
        self.prompt = prompt
        self.params = params
        self.text = TextAssembler(params.stop)
        self.seq_id = -1
        self.prefilled = 0  # prompt tokens already submitted
        self.generated = 0
        self.last_token = -1
        self.sampler = sampler
        self.grammar = grammar  # freed with the sequence
        self.chain: DeviceChain | None = None  # sampled inside llama_decode (set at admission)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


class NativeLoop:
    """What both llama.cpp engines (this one and engines/embedding) share: one worker thread
    that owns the native context, woken through `_cond`, and the native memory freed only
    once that thread has stopped."""

    _cond: threading.Condition
    _stopping: bool
    _thread: threading.Thread | None

    def _free(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._free()


class LlamaCppEngine(NativeLoop):
    """The `Engine` for GGUF models through llama.cpp: on the CPU, or with `gpu_layers` of the
    model (and their KV cache) in GPU memory when llama.cpp was built with CUDA."""

    def __init__(
        self,
        model_path: Path,
        *,
        context_length: int,
        capacity: int,
        threads: int,
        max_queue: int,
        model_id: str | None = None,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        deterministic: bool = False,
        prefix_cache: bool | None = None,
        repack: bool | None = None,
        kv_unified: bool | None = None,
        gpu_layers: int = 0,
        sampler_threads: int | None = None,
        device_sampling: DeviceSampling = DeviceSampling.AUTO,
        observer: StepObserver | None = None,
    ) -> None:
        if not 1 <= capacity <= 256:
            raise ValueError(f"capacity must be within 1..256, got {capacity}")
        self.info = EngineInfo(
            name="llamacpp",
            model_id=model_id or model_path.stem,
            context_length=context_length,
            features=frozenset({"logprobs", "grammar", "sampling"}),
        )
        self._path = model_path
        self._capacity = capacity
        self._threads = threads
        self._max_queue = max_queue
        self._step_tokens = step_tokens
        # A step carries every decode row plus up to step_tokens prompt tokens.
        self._batch_tokens = step_tokens + capacity
        self._observer = observer
        self._max_batch = capacity
        self._cond = threading.Condition()
        self._pending: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._free_ids = list(range(capacity))  # least recently used first
        self._slot_cache: list[list[int]] = [[] for _ in range(capacity)]
        self._freed_at = [0] * capacity  # the step each seq_id was last released at
        # Both change kernel shapes between a request alone and batched: off when deterministic.
        self._prefix_cache = (not deterministic) if prefix_cache is None else prefix_cache
        self._repack = (not deterministic) if repack is None else repack
        self._deterministic = deterministic
        # Layers in device memory; their KV cache goes with them (llama.cpp's offload_kqv).
        self._gpu_layers = gpu_layers
        # One KV pool for all sequences (llama-server's -kvu): a batch is one micro-batch
        # whatever its mix of sequences; per-sequence streams need equal-length splits.
        # Never in deterministic mode: attention would span other sequences' (masked) cells.
        self._unified = unified_kv(deterministic, kv_unified)
        self._policy = Policy(deterministic=deterministic, step_tokens=step_tokens)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_step_sequences = 0
        self._steps = 0
        self._pieces: dict[int, bytes] = {}
        self._risky: dict[bytes, np.ndarray] = {}  # _risky_tokens, by the marker's first byte
        self._eog: dict[int, bool] = {}
        self._ll: Any = None
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._mem: Any = None
        self._batch: Any = None
        self._n_vocab = 0
        self._chat_template: str | None = None
        self._builtin_template: str | None = None
        self._eog_all: tuple[int, ...] | None = None
        self._pool = _sampler_pool(threads, sampler_threads)
        self._device_mode = device_sampling
        self._on_device = False  # resolved at load: is there a device to sample on?
        self.device_rows = 0  # tokens drawn inside llama_decode (device chains) so far
        self._chains: dict[int, DeviceChain] = {}  # attached to each seq_id (they stay)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(loaded,), name="ember-decode", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(loaded)

    def _main(self, loaded: concurrent.futures.Future[None]) -> None:
        """The decode thread: loads the model, then runs the decode loop.

        Every llama.cpp call that computes (the warm-up, the row probe, each step) happens on
        this one thread. llama.cpp's CPU backend is built with OpenMP, and libgomp keeps a
        team of worker threads per thread that has called into it; once the process has more
        of those threads than CPUs (a second calling thread on 2 CPUs is enough), libgomp
        stops spinning at its barriers and sleeps on a futex at each of the hundreds of
        barriers in a forward pass. Measured on the 2-core box with a bare decode loop: a
        single-stream token took 12.4-12.8 ms from a second calling thread, 10.7 ms from the
        first (main or not); in the engine, 12.3 ms before this and 10.9 ms after.
        """
        try:
            self._load()
        except BaseException as exc:  # handed to start()'s caller, whatever it is
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._run()

    def _load(self) -> None:
        self._ll, self._model = load_model(
            self._path, gpu_layers=self._gpu_layers, repack=self._repack
        )
        ll = self._ll
        self._ctx = ll.llama_init_from_model(self._model, self._context_params(ll))
        if not self._ctx:
            raise EngineUnavailableError("llama.cpp could not create a context (memory?)")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.info.vocab_size = self._n_vocab
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(self._batch_tokens, 0, 1)
        template = ll.llama_model_chat_template(self._model, None)
        self._chat_template = template.decode() if template else None
        self._builtin_template = None if template else self._builtin_template_name()
        if not template:
            # Usually a pretrained (base) checkpoint: e.g. the packaged google/gemma-3-270m,
            # which echoes a chat prompt instead of answering it (llama-server does the same).
            log.warning(
                "%s has no tokenizer.chat_template (often a base, not instruction-tuned, "
                "model: chat replies will be poor); chat uses llama.cpp's built-in %r template",
                self._path.name,
                self._builtin_template,
            )
        self._on_device = device_sampling.resolve(
            self._device_mode,
            offloaded=self._gpu_layers > 0 and bool(ll.llama_supports_gpu_offload()),
            deterministic=self._deterministic,
        )
        self._warm_up()
        started = time.perf_counter()
        self._risky_tokens(OPEN[:1].encode())  # here, not in a decode step that others wait on
        log.info("vocabulary scanned for tool calls in %.2f s", time.perf_counter() - started)
        if self._deterministic:
            rows = self._probe_rows(min(self._capacity, _PROBE_MAX_ROWS))
            self._policy = Policy(
                deterministic=True, step_tokens=self._step_tokens, exact_rows=rows
            )
        log.info(
            "llama.cpp engine ready: %s, capacity %d, %d tokens/sequence, %d thread(s), %s, "
            "%d prompt tokens per step, prefix cache %s, repacked weights %s, %d GPU layers "
            "(GPU offload %s), sampling %s",
            self._path.name,
            self._capacity,
            self.info.context_length,
            self._threads,
            f"deterministic ({self._policy.exact_rows} rows per decode, probed)"
            if self._deterministic
            else "fast batching",
            self._step_tokens,
            "on" if self._prefix_cache else "off",
            "allowed" if self._repack else "off",
            self._gpu_layers,
            "supported" if ll.llama_supports_gpu_offload() else "not built in",
            "in llama_decode where eligible" if self._on_device else "on the host",
        )

    @property
    def exact_rows(self) -> int:
        """Deterministic mode's widest `llama_decode` (probed on this CPU at load); 0 when fast."""
        return self._policy.exact_rows if self._deterministic else 0

    def _context_params(self, ll: Any) -> Any:
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.info.context_length * self._capacity
        cparams.n_batch = self._batch_tokens
        cparams.n_ubatch = self._batch_tokens
        cparams.n_seq_max = self._capacity
        # Logits for one token per sequence at most: sizing the output buffer for the whole
        # batch would cost n_batch x 262k floats (hundreds of MiB) for nothing.
        cparams.n_outputs_max = self._capacity
        # One output per sequence per decode: device samplers size their buffers for one.
        cparams.n_outputs_max_per_seq = 1
        cparams.n_threads = self._threads
        cparams.n_threads_batch = self._threads
        cparams.kv_unified = self._unified
        cparams.no_perf = True
        return cparams

    def _warm_up(self) -> None:
        ll = self._ll
        bos = ll.llama_vocab_bos(self._vocab)
        self._fill([(max(bos, 0), 0, 0, True)])
        if ll.llama_decode(self._ctx, self._batch) != 0:
            raise EngineUnavailableError("llama.cpp failed the warm-up decode")
        ll.llama_memory_seq_rm(self._mem, 0, -1, -1)

    def _probe_rows(self, widest: int) -> int:
        """The widest decode whose rows come out bit-identical to the same rows decoded alone.

        Each of `widest` sequences gets a short context of its own, then one more token is
        decoded alone (the reference logits) and in batches of 2, 3, … rows: the first width
        whose logits differ from the references ends the probe. Exact batching needs every
        width up to its limit to agree (a step's last group can be any size), so the scan
        stops at the first mismatch. Costs about 2 x widest passes over the weights, once.
        """
        ll, mem = self._ll, self._mem
        vocab, first = self._n_vocab, max(int(ll.llama_vocab_bos(self._vocab)), 0) + 1

        def token(i: int) -> int:  # distinct tokens, so every row of a batch differs
            return (first + i) % vocab

        for sid in range(widest):
            self._fill([(token(sid + i), i, sid, False) for i in range(_PROBE_PREFIX)])
            self._decode_or_fail("probe prefix")
        rows = [(token(100 + sid), _PROBE_PREFIX, sid, True) for sid in range(widest)]
        alone = []
        for row in rows:
            alone.append(self._probe_logits([row])[0])
        agreed = 1
        for width in range(2, widest + 1):
            together = self._probe_logits(rows[:width])
            if any(not np.array_equal(a, b) for a, b in zip(alone, together, strict=False)):
                break
            agreed = width
        for sid in range(widest):
            ll.llama_memory_seq_rm(mem, sid, -1, -1)
        return agreed

    def _probe_logits(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode `rows` (one per sequence) in one call; their logits, then forget the rows."""
        self._fill(rows)
        self._decode_or_fail("probe")
        out = [
            np.ctypeslib.as_array(
                self._ll.llama_get_logits_ith(self._ctx, i), (self._n_vocab,)
            ).copy()
            for i in range(len(rows))
        ]
        for _tok, pos, sid, _want in rows:
            self._ll.llama_memory_seq_rm(self._mem, sid, pos, -1)
        return out

    def _decode_or_fail(self, what: str) -> None:
        if self._ll.llama_decode(self._ctx, self._batch) != 0:
            raise EngineUnavailableError(f"llama.cpp failed the {what} decode")

    def _free(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        ll = self._ll
        if ll is None:
            return
        for seq in list(self._running):  # _release removes it from _running
            self._release(seq)
        for chain in self._chains.values():
            chain.free(self._ctx)
        self._chains.clear()
        free_native(ll, self._batch, self._ctx, self._model)
        self._batch = self._ctx = self._model = None

    # --- the Engine API (event loop side) ----------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return tokenize(self._ll, self._vocab, text, add_special=add_special)

    def render_chat(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The GGUF's Jinja template when it has one, else llama.cpp's built-in template for the
        model's architecture (also from GGUF metadata). Tools and tool turns go to a template
        that knows tools; otherwise they are rewritten in Ember's built-in format first. The
        text starts with the BOS marker, so tokenize it with add_special=False."""
        template = self._chat_template
        if tools_in_messages(messages, tools) and not (template and "tool" in template):
            messages, tools = builtin_messages(messages, tools), None
        bos = self._special_text(self._ll.llama_vocab_bos(self._vocab))
        if template is not None:
            eos = self._special_text(self._ll.llama_vocab_eos(self._vocab))
            return render_template(template, messages, bos_token=bos, eos_token=eos, tools=tools)
        if self._builtin_template is None:
            raise ValueError("the model has no chat template and no built-in one is known")
        return bos + self._apply_builtin(self._builtin_template, messages)

    def _builtin_template_name(self) -> str | None:
        buf = ctypes.create_string_buffer(128)
        n = self._ll.llama_model_meta_val_str(self._model, b"general.architecture", buf, 128)
        arch = buf.value.decode() if n > 0 else ""
        # llama.cpp's own names (src/llama-chat.cpp); only families whose format is certain.
        for prefix, name in (("gemma", "gemma"), ("qwen", "chatml")):
            if arch.startswith(prefix):
                return name
        return None

    def _apply_builtin(self, name: str, messages: list[ChatMessage]) -> str:
        ll = self._ll
        chat = (ll.llama_chat_message * len(messages))()
        for i, m in enumerate(messages):
            chat[i].role = m.role.encode()
            chat[i].content = m.content.encode()
        size = 2 * sum(len(m.content) for m in messages) + 256
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(name.encode(), chat, len(messages), True, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n + 1)
            n = ll.llama_chat_apply_template(name.encode(), chat, len(messages), True, buf, n + 1)
        if n < 0:
            raise ValueError(f"llama.cpp's {name!r} chat template rejected the messages")
        return buf.raw[:n].decode("utf-8", "replace")

    def submit(self, prompt: list[int], params: SamplingParams) -> _Stream:
        if not prompt:
            raise ValueError("the prompt is empty")
        stream = _Stream(self, len(prompt))
        with self._cond:
            if self._stopping:
                raise EngineStoppingError("the engine is shutting down")
            waiting = queued(
                len(self._running), len(self._pending), self._max_batch, len(self._free_ids)
            )
            if waiting >= self._max_queue:
                raise QueueFullError(waiting)
        # Built here, on the event loop, so a grammar that llama.cpp cannot parse is the
        # client's 400 rather than an error delta later (it only reads the vocabulary).
        sampler, grammar = self._make_sampler(prompt, params)
        with self._cond:
            self._pending.append(_Sequence(stream, prompt, params, sampler, grammar))
            self._cond.notify()
        return stream

    def set_max_batch_size(self, n: int) -> None:
        if not 1 <= n <= self._capacity:
            raise ValueError(f"maxBatchSize must be within 1..{self._capacity}, got {n}")
        with self._cond:
            self._max_batch = n
            self._cond.notify()

    def state(self) -> EngineState:
        return EngineState(
            max_batch_size=self._max_batch,
            capacity=self._capacity,
            active=len(self._running),
            queued=len(self._pending),
            last_step_sequences=self._last_step_sequences,
            steps=self._steps,
        )

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # --- the decode loop (its own thread) --------------------------------------------------

    def _run(self) -> None:
        try:
            while self._schedule():
                self._step()
        except Exception:  # a bug here must not leave clients hanging forever
            log.exception("decode loop crashed")
            self._fail_all("the decode loop crashed")
        finally:
            self._fail_all("the engine stopped")

    def _schedule(self) -> bool:
        """Wait for work, drop cancelled requests, admit new ones; False when stopping."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._stopping:
                    return False
                joining = admissible(
                    len(self._running), len(self._pending), self._max_batch, len(self._free_ids)
                )
                self._admit_some(joining)
                if self._running:
                    self._compact()
                    return True
                self._cond.wait()

    def _drop_cancelled(self) -> None:
        if any(s.stream.cancelled for s in self._pending):
            kept = [s for s in self._pending if not s.stream.cancelled]
            for seq in self._pending:
                if seq.stream.cancelled:
                    self._free_sampler(seq)
            self._pending.clear()
            self._pending.extend(kept)
        done = [s for s in self._running if s.stream.cancelled]
        for seq in done:
            self._finish(seq, Delta("", 0, FinishReason.CANCELLED), deliver_now=True)

    def _admit_some(self, joining: int) -> None:
        """Admit up to `joining` pending requests in order, holding back one whose prompt a
        running request is still computing (the samples of an `n` > 1 request, or a retry):
        once that prompt is in the KV pool it is shared, and only the last token is decoded
        again (`_share_live_prefix`), instead of every copy computing the whole prompt."""
        held: list[_Sequence] = []
        while joining and self._pending:
            seq = self._pending.popleft()
            if self._computing(seq.prompt):
                held.append(seq)
                continue
            self._admit(seq)
            joining -= 1
        self._pending.extendleft(reversed(held))

    def _computing(self, prompt: list[int]) -> bool:
        if not (self._unified and self._prefix_cache):
            return False  # nothing would be shared: no reason to wait
        return any(r.prefilled < len(r.prompt) and r.prompt == prompt for r in self._running)

    def _admit(self, seq: _Sequence) -> None:
        seq.seq_id, reused = self._pick_slot(seq.prompt)
        seq.prefilled = reused
        seq.chain = self._chain_for(seq.seq_id, seq.params)
        self._running.append(seq)

    def _chain_for(self, sid: int, params: SamplingParams) -> DeviceChain | None:
        """The device chain that samples `sid`'s next request: the one already attached when
        it computes the same (no rebuild), else a new one; None: the host samples it (then no
        chain may stay attached, or llama.cpp would not copy this row's logits out)."""
        held = self._chains.get(sid)
        want = self._on_device and device_sampling.eligible(params)
        key = device_sampling.reuse_key(params)
        if want and held is not None and key is not None and held.key == key:
            return held
        if held is not None:
            held.free(self._ctx)
            del self._chains[sid]
        if not want:
            return None
        chain = DeviceChain(self._ll, self._n_vocab, params)
        if not chain.attach(self._ctx, sid):  # this backend lacks an op: the host samples
            chain.free(self._ctx)
            return None
        self._chains[sid] = chain
        return chain

    def _pick_slot(self, prompt: list[int]) -> tuple[int, int]:
        """A free seq_id, preferring the one whose cached prompt shares the longest prefix.

        Returns (seq_id, tokens already in its KV cache). At least the last prompt token is
        always decoded again, because sampling needs its logits.
        """
        best, best_len = 0, -1
        for i, sid in enumerate(self._free_ids):
            common = _common_prefix(self._slot_cache[sid], prompt)
            # Ties go to the lowest seq_id: the running set then stays on 0..n-1 (see _compact).
            if common > best_len or (common == best_len and sid < self._free_ids[best]):
                best, best_len = i, common
        sid = self._free_ids.pop(best)
        keep = min(best_len, len(prompt) - 1)
        if keep <= 0 or not self._ll.llama_memory_seq_rm(self._mem, sid, keep, -1):
            self._ll.llama_memory_seq_rm(self._mem, sid, -1, -1)
            keep = 0
        self._slot_cache[sid] = []
        if self._unified and self._prefix_cache:
            keep = max(keep, self._share_live_prefix(sid, prompt, keep))
        return sid, keep

    def _share_live_prefix(self, sid: int, prompt: list[int], have: int) -> int:
        """Unified KV only: let `sid` share the computed prompt cells of a running sequence
        that has a longer common prefix than `have` (one pool: a copy only tags the cells
        with one more seq_id, no data moves). Returns the tokens now cached, or 0."""
        donor, shared = None, have
        for seq in self._running:
            common = _common_prefix(seq.prompt[: seq.prefilled], prompt)
            if common > shared:
                donor, shared = seq, common
        shared = min(shared, len(prompt) - 1)
        if donor is None or shared <= have:
            return 0
        self._ll.llama_memory_seq_rm(self._mem, sid, -1, -1)
        self._ll.llama_memory_seq_cp(self._mem, donor.seq_id, sid, 0, shared)
        return shared

    def _compact(self) -> None:
        """Keep the running sequences on seq_ids 0..n-1.

        With one KV stream per sequence, llama.cpp cuts a batch into ubatches of *consecutive*
        seq_ids (`split_equal(sequential=true)`), and every ubatch is a full pass over the
        weights: running seq_ids {0, 2, 5} would cost three passes per step instead of one.
        A sequence above n moves into a hole below n: llama.cpp copies the whole stream buffer
        (cells keep their indices and positions, so the numbers do not change) at the start
        of the next decode, a few MB once per finished request.
        """
        if self._unified:
            return  # one stream: any seq_ids go in one micro-batch, nothing to move
        n = len(self._running)
        # With the prefix cache, a just-freed seq_id holds a prompt that its client's next
        # request is likely to repeat within a step or two: let it be reused before filling it.
        settled = self._steps - (2 if self._prefix_cache else 0)
        holes = sorted(
            (sid for sid in self._free_ids if sid < n and self._freed_at[sid] <= settled),
            reverse=True,
        )
        for seq in self._running:
            if seq.seq_id >= n and holes:
                self._move(seq, holes.pop())

    def _move(self, seq: _Sequence, dst: int) -> None:
        ll, mem, src = self._ll, self._mem, seq.seq_id
        ll.llama_memory_seq_cp(mem, src, dst, -1, -1)  # cross-stream: a deferred buffer copy
        ll.llama_memory_seq_rm(mem, src, -1, -1)
        if dst in self._chains:
            self._chains.pop(dst).free(self._ctx)
        if seq.chain is not None:
            del self._chains[src]
            if seq.chain.move(self._ctx, dst):
                self._chains[dst] = seq.chain
            else:  # cannot happen: it ran on this device before
                seq.chain.free(self._ctx)
                seq.chain = None
        self._free_ids.remove(dst)
        self._free_ids.append(src)
        self._slot_cache[dst] = []  # its cached prefix (if any) was just overwritten
        self._slot_cache[src] = []
        seq.seq_id = dst

    def _make_sampler(
        self, prompt: list[int], params: SamplingParams
    ) -> tuple[sampling.RowSampler, _Grammar | None]:
        """The numpy sampler for a request, with llama.cpp's grammar as its mask (if any)."""
        grammar = None
        if params.grammar is not None:
            grammar = _Grammar(
                self._ll,
                self._vocab,
                self._n_vocab,
                params.grammar,
                free_until=params.grammar_free_until.encode(),
                risky=self._risky_tokens,
                piece=functools.partial(self._token_bytes, special=True),
            )
        eog = self._eog_tokens() if params.ignore_eos else ()
        row = sampling.RowSampler(
            params, prompt, eog_tokens=eog, grammar=grammar.mask if grammar else None
        )
        return row, grammar

    def _risky_tokens(self, first: bytes) -> np.ndarray:
        """Tokens a free-text grammar may refuse: those holding `first` (as the grammar sees
        them, special text included) or not UTF-8 on their own (see _Grammar). Decode thread."""
        ids = self._risky.get(first)
        if ids is None:
            ids = np.fromiter(
                (t for t, p in enumerate(self._all_pieces()) if first in p or not _utf8_ok(p)),
                np.int32,
            )
            self._risky[first] = ids
        return ids

    def _all_pieces(self) -> Iterator[bytes]:
        """Every token's text as the grammar sampler sees it (special tokens as text)."""
        buf = ctypes.create_string_buffer(256)
        to_piece, vocab = self._ll.llama_token_to_piece, self._vocab
        for tok in range(self._n_vocab):
            n = to_piece(vocab, tok, buf, 256, 0, True)
            yield buf.raw[:n] if 0 <= n <= 256 else self._token_bytes(tok, special=True)

    def _eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token (what `ignore_eos` bans, as llama-server does)."""
        if self._eog_all is None:
            is_eog = self._ll.llama_vocab_is_eog
            self._eog_all = tuple(t for t in range(self._n_vocab) if is_eog(self._vocab, t))
        return self._eog_all

    def _free_sampler(self, seq: _Sequence) -> None:
        seq.chain = None  # it stays attached to the seq_id for the next request (_chain_for)
        if seq.grammar is not None:
            seq.grammar.free()
            seq.grammar = None

    def _step(self) -> None:
        """One scheduling step: the calls `plan_step` chose, each decoded then sampled."""
        active, _paused = split_active(self._running, self._max_batch)
        active.sort(key=lambda seq: seq.seq_id)  # consecutive ids: one ubatch (see _compact)
        began = time.perf_counter()
        prompt_tokens = 0
        for call in plan_step(active, self._policy):
            outputs = self._fill_call(call)
            prompt_tokens += call.rows - len(call.decodes)
            rc = self._ll.llama_decode(self._ctx, self._batch)
            if rc != 0:
                self._fail_batch(active, f"llama_decode failed with status {rc}")
                return
            self._sample(outputs)
        self._steps += 1
        self._last_step_sequences = len(active)
        if self._observer is not None:
            self._observer(StepStats(time.perf_counter() - began, len(active), prompt_tokens))

    def _fill_call(self, call: Call[_Sequence]) -> list[tuple[_Sequence, int]]:
        """Put one call's rows in the batch; returns (sequence, row) for each row to sample."""
        entries: list[tuple[int, int, int, bool]] = []
        outputs: list[tuple[_Sequence, int]] = []
        for seq in call.decodes:
            outputs.append((seq, len(entries)))
            pos = seq.prefilled + seq.generated - 1  # the last sampled token's position
            entries.append((seq.last_token, pos, seq.seq_id, True))
        for chunk in call.chunks:
            seq, last = chunk.seq, chunk.start + chunk.count - 1
            for i in range(chunk.start, last + 1):
                entries.append((seq.prompt[i], i, seq.seq_id, False))
            if chunk.completes_prompt:
                outputs.append((seq, len(entries) - 1))
                entries[-1] = (seq.prompt[last], last, seq.seq_id, True)
            seq.prefilled = last + 1
        self._fill(entries)
        return outputs

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self._batch
        token, pos, n_seq, seq_ids, logits = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        for i, (tok, p, sid, want) in enumerate(entries):
            token[i] = tok
            pos[i] = p
            n_seq[i] = 1
            seq_ids[i][0] = sid
            logits[i] = want
        batch.n_tokens = len(entries)

    def _sample(self, outputs: list[tuple[_Sequence, int]]) -> None:
        emits: list[tuple[_Stream, Delta]] = []
        for seq, tok, row in self._tokens(outputs):
            seq.sampler.accept(tok)
            if seq.grammar is not None:
                seq.grammar.accept(tok)
            if seq.chain is not None:
                seq.chain.accept(tok)
            delta = self._advance(seq, tok, row)
            if delta is not None:
                emits.append((seq.stream, delta))
                if delta.finish_reason is not None:
                    self._release(seq)
        if emits and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, emits)

    def _tokens(
        self, outputs: list[tuple[_Sequence, int]]
    ) -> list[tuple[_Sequence, int, np.ndarray | None]]:
        """Each output's token: drawn in the decode (a device chain) or here from its logits
        row. llama.cpp copies the logits to the host only when some row needs them."""
        ll, ctx = self._ll, self._ctx
        picked: list[tuple[_Sequence, int, np.ndarray | None]] = []
        host: list[tuple[_Sequence, np.ndarray]] = []
        for seq, idx in outputs:
            if seq.chain is None:
                row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), (self._n_vocab,))
                host.append((seq, row))
                continue
            tok = seq.chain.token(ctx, idx)
            if tok < 0:  # the chain ran nowhere: a llama.cpp invariant broke
                raise EngineError(f"llama.cpp drew no token for sequence {seq.seq_id}")
            picked.append((seq, tok, None))
        self.device_rows += len(picked)
        if host:
            chosen = self._choose([seq for seq, _ in host], [row for _, row in host])
            picked += [(seq, tok, row) for (seq, row), tok in zip(host, chosen, strict=True)]
        return picked

    def _choose(self, seqs: list[_Sequence], rows: list[np.ndarray]) -> list[int]:
        """Each row's token. Rows that need more than an argmax go to the sampler pool where
        there is one (spare cores: numpy's passes release the GIL), else in turn here."""
        picks: list[int | None] = [
            sampling.greedy(row) if seq.sampler.plain_greedy else None
            for seq, row in zip(seqs, rows, strict=True)
        ]
        todo = [i for i, tok in enumerate(picks) if tok is None]
        if self._pool is not None and len(todo) > 1:
            drawn = list(self._pool.map(lambda i: seqs[i].sampler.sample(rows[i]), todo))
        else:
            drawn = [seqs[i].sampler.sample(rows[i]) for i in todo]
        for i, tok in zip(todo, drawn, strict=True):
            picks[i] = tok
        return [int(tok) for tok in picks if tok is not None]

    def _advance(self, seq: _Sequence, tok: int, row: np.ndarray | None) -> Delta | None:
        seq.last_token = tok
        if self._is_eog(tok):
            return Delta(seq.text.flush(), 0, FinishReason.STOP)
        seq.generated += 1
        piece = self._piece(tok)
        text, stopped = seq.text.push(piece)
        top = seq.params.logprobs
        lp = () if top is None or row is None else (self._logprob(row, tok, top),)
        if stopped:
            return Delta(text, 1, FinishReason.STOP, logprobs=lp)
        full = seq.prefilled + seq.generated >= self.info.context_length
        if seq.generated >= seq.params.max_tokens or full:
            return Delta(text + seq.text.flush(), 1, FinishReason.LENGTH, logprobs=lp)
        return Delta(text, 1, logprobs=lp)

    def _logprob(self, row: np.ndarray, tok: int, top: int) -> TokenLogprob:
        chosen, best = sampling.logprobs(row, tok, top)
        alternatives = tuple(TopLogprob(*self._token_text(t), lp) for t, lp in best)
        return TokenLogprob(*self._token_text(tok), chosen, alternatives)

    def _token_text(self, tok: int) -> tuple[str, bytes]:
        piece = self._piece(tok)
        return piece.decode("utf-8", "replace"), piece

    def _finish(self, seq: _Sequence, delta: Delta, *, deliver_now: bool) -> None:
        self._release(seq)
        if deliver_now and self._loop is not None:
            self._loop.call_soon_threadsafe(seq.stream.put, delta)

    def _release(self, seq: _Sequence) -> None:
        """Leave the batch: clear the generated tokens' KV cells and return the seq_id.

        With the prefix cache on, the prompt's cells stay as a reusable prefix for the next
        request placed on this seq_id (cleared there if the next prompt differs); off, the
        sequence's cells are cleared entirely.
        """
        sid = seq.seq_id
        if sid < 0:
            return
        kept = seq.prefilled if self._prefix_cache else 0
        if kept == 0 or not self._ll.llama_memory_seq_rm(self._mem, sid, kept, -1):
            self._ll.llama_memory_seq_rm(self._mem, sid, -1, -1)
            kept = 0
        self._slot_cache[sid] = seq.prompt[:kept]
        self._free_sampler(seq)
        self._free_ids.append(sid)
        self._freed_at[sid] = self._steps
        seq.seq_id = -1
        self._running.remove(seq)

    def _fail_batch(self, seqs: list[_Sequence], message: str) -> None:
        log.error("%s; failing %d sequence(s)", message, len(seqs))
        for seq in list(seqs):
            seq.prefilled = 0  # the cache state is unknown now: keep nothing for reuse
            self._finish(seq, Delta("", 0, FinishReason.ERROR, message), deliver_now=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self._pending) + list(self._running)
            self._pending.clear()
        for seq in waiting:
            delta = Delta("", 0, FinishReason.CANCELLED, message)
            if seq.seq_id >= 0:
                self._finish(seq, delta, deliver_now=True)
            else:
                self._free_sampler(seq)
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(seq.stream.put, delta)

    # --- vocabulary helpers -----------------------------------------------------------------

    def _piece(self, tok: int) -> bytes:
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self._token_bytes(tok, special=False)
            self._pieces[tok] = piece
        return piece

    def _is_eog(self, tok: int) -> bool:
        eog = self._eog.get(tok)
        if eog is None:
            eog = bool(self._ll.llama_vocab_is_eog(self._vocab, tok))
            self._eog[tok] = eog
        return eog

    def _special_text(self, tok: int) -> str:
        return "" if tok < 0 else self._token_bytes(tok, special=True).decode("utf-8", "replace")

    def _token_bytes(self, tok: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._ll.llama_token_to_piece(self._vocab, tok, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, tok, buf, len(buf), 0, special)
        if n < 0:
            raise EngineError(f"cannot detokenize token {tok}")
        return buf.raw[:n]


def _sampler_pool(
    engine_threads: int, wanted: int | None
) -> concurrent.futures.ThreadPoolExecutor | None:
    """Threads that draw a step's rows in parallel (numpy's passes release the GIL), or None:
    the draws then run one after another on the decode thread. `wanted` None takes the cores
    llama.cpp's threads leave spare (a GPU host: a 64-row step's draws would otherwise queue),
    up to 8, and none on a small CPU box."""
    if wanted is None:
        spare = len(os.sched_getaffinity(0)) - engine_threads
        wanted = min(spare, _MAX_SAMPLER_THREADS) if spare >= _MIN_SAMPLER_THREADS else 0
    if wanted <= 1:
        return None
    return concurrent.futures.ThreadPoolExecutor(wanted, thread_name_prefix="ember-sample")


def _utf8_ok(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return piece[:1] not in (b"", b"\0")  # llama.cpp's grammar refuses these outright


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _deliver(emits: list[tuple[_Stream, Delta]]) -> None:
    for stream, delta in emits:
        stream.put(delta)
