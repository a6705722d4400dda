"""llama.cpp's native side, through llama-cpp-python's ctypes bindings: load a model, read its
vocabulary, make a context and fill its batch, decode. Both llama.cpp engines stand on it
(generation, engines/llamacpp.py; embeddings, engines/embedding.py); it decides nothing about
who decodes when (that is engines/scheduler.py and the engines).

Every call that computes runs on one thread per engine (`NativeLoop`; engines/llamacpp.py's
`_main` says why). ctypes releases the GIL during `llama_decode`, so the event loop keeps
serving while it runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember_runtime.engines.base import ChatMessage, EngineError, EngineUnavailableError

log = logging.getLogger(__name__)

# One row of a batch: (token, position, seq_id, whether the decode outputs its logits).
Row = tuple[int, int, int, bool]

_PROBE_PREFIX = 3  # tokens of context per probe sequence, so attention has cells to read
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
    raises EngineUnavailableError with the reason."""
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
    """Free what load_model and a context made, batch first, model last; None or NULL parts
    are skipped."""
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


def fill_batch(batch: Any, rows: Sequence[Row]) -> None:
    """Put `rows` in `batch` (a `llama_batch` from `llama_batch_init`, one seq_id per row)."""
    token, pos, n_seq, seq_ids, logits = (
        batch.token,
        batch.pos,
        batch.n_seq_id,
        batch.seq_id,
        batch.logits,
    )
    for i, (tok, p, sid, want) in enumerate(rows):
        token[i] = tok
        pos[i] = p
        n_seq[i] = 1
        seq_ids[i][0] = sid
        logits[i] = want
    batch.n_tokens = len(rows)


class NativeLoop:
    """What both llama.cpp engines share: one worker thread that owns the native context,
    woken through `_cond`, and the native memory freed only once that thread has stopped."""

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


class Vocab:
    """A model's vocabulary: tokenizing, each token's text (cached), end-of-generation tokens."""

    __slots__ = ("_eog", "_eog_all", "_pieces", "handle", "ll", "size")

    def __init__(self, ll: Any, model: Any) -> None:
        self.ll = ll
        self.handle = ll.llama_model_get_vocab(model)
        self.size = int(ll.llama_vocab_n_tokens(self.handle))
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_all: tuple[int, ...] | None = None

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return tokenize(self.ll, self.handle, text, add_special=add_special)

    def bos(self) -> int:
        return int(self.ll.llama_vocab_bos(self.handle))

    def eos(self) -> int:
        return int(self.ll.llama_vocab_eos(self.handle))

    def piece(self, tok: int) -> bytes:
        """The text a generated token adds (special tokens render as nothing)."""
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self.token_bytes(tok, special=False)
            self._pieces[tok] = piece
        return piece

    def is_eog(self, tok: int) -> bool:
        eog = self._eog.get(tok)
        if eog is None:
            eog = bool(self.ll.llama_vocab_is_eog(self.handle, tok))
            self._eog[tok] = eog
        return eog

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token (what `ignore_eos` bans, as llama-server does)."""
        if self._eog_all is None:
            is_eog, handle = self.ll.llama_vocab_is_eog, self.handle
            self._eog_all = tuple(t for t in range(self.size) if is_eog(handle, t))
        return self._eog_all

    def special_text(self, tok: int) -> str:
        """A special token's text (a template's BOS or EOS marker); "" for none (-1)."""
        return "" if tok < 0 else self.token_bytes(tok, special=True).decode("utf-8", "replace")

    def token_bytes(self, tok: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self.ll.llama_token_to_piece(self.handle, tok, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.ll.llama_token_to_piece(self.handle, tok, buf, len(buf), 0, special)
        if n < 0:
            raise EngineError(f"cannot detokenize token {tok}")
        return buf.raw[:n]

    def all_pieces(self) -> Iterator[bytes]:
        """Every token's text as the grammar sampler sees it (special tokens as text)."""
        buf = ctypes.create_string_buffer(256)
        to_piece, handle = self.ll.llama_token_to_piece, self.handle
        for tok in range(self.size):
            n = to_piece(handle, tok, buf, 256, 0, True)
            yield buf.raw[:n] if 0 <= n <= 256 else self.token_bytes(tok, special=True)


class LlamaContext:
    """The generation engine's native state: the model, one context whose KV memory holds every
    sequence (`sequences` of `sequence_tokens` cells), the batch each step fills, and the
    calls on them. Empty until `open` (on the decode thread)."""

    def __init__(
        self,
        path: Path,
        *,
        sequences: int,
        sequence_tokens: int,
        batch_tokens: int,
        threads: int,
        unified: bool,
        gpu_layers: int,
        repack: bool,
        draft_rows: int = 0,
        draft_per_sequence: int = 0,
    ) -> None:
        self.path = path
        self._sequences = sequences
        # Speculative drafts (engines/speculative.py): output rows a step may add beyond one
        # per sequence, and how many of them one sequence may have.
        self._draft_rows = draft_rows
        self._draft_per_sequence = draft_per_sequence
        self._sequence_tokens = sequence_tokens
        self._batch_tokens = batch_tokens
        self._threads = threads
        self._unified = unified
        self._gpu_layers = gpu_layers
        self._repack = repack
        self.ll: Any = None
        self.model: Any = None
        self.ctx: Any = None
        self.mem: Any = None
        self.batch: Any = None
        self._vocab: Vocab | None = None

    def open(self) -> Vocab:
        """Load the model and make the context and batch; the model's vocabulary."""
        self.ll, self.model = load_model(
            self.path, gpu_layers=self._gpu_layers, repack=self._repack
        )
        ll = self.ll
        self.ctx = ll.llama_init_from_model(self.model, self._context_params())
        if not self.ctx:
            raise EngineUnavailableError("llama.cpp could not create a context (memory?)")
        self._vocab = Vocab(ll, self.model)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(self._batch_tokens, 0, 1)
        return self._vocab

    @property
    def vocab(self) -> Vocab:
        if self._vocab is None:
            raise EngineUnavailableError("the model is not loaded")
        return self._vocab

    def _context_params(self) -> Any:
        cparams = self.ll.llama_context_default_params()
        cparams.n_ctx = self._sequence_tokens * self._sequences
        cparams.n_batch = self._batch_tokens
        cparams.n_ubatch = self._batch_tokens
        cparams.n_seq_max = self._sequences
        # Logits for one token per sequence at most, plus the drafts' rows: sizing the output
        # buffer for the whole batch would cost n_batch x 262k floats (hundreds of MiB).
        cparams.n_outputs_max = self._sequences + self._draft_rows
        # One output per sequence per decode (device samplers size their buffers for it), or
        # one per token of a draft being verified; a device-sampled sequence never drafts.
        cparams.n_outputs_max_per_seq = 1 + self._draft_per_sequence
        cparams.n_threads = self._threads
        cparams.n_threads_batch = self._threads
        cparams.kv_unified = self._unified
        cparams.no_perf = True
        return cparams

    def close(self) -> None:
        if self.ll is not None:
            free_native(self.ll, self.batch, self.ctx, self.model)
        self.batch = self.ctx = self.model = None

    def offloads(self) -> bool:
        """Whether this llama.cpp build can put layers on a GPU."""
        return bool(self.ll.llama_supports_gpu_offload())

    # --- decoding ----------------------------------------------------------------------------

    def fill(self, rows: Sequence[Row]) -> None:
        fill_batch(self.batch, rows)

    def batch_limit(self) -> int:
        """Rows one decode may take: the batch asked for, or fewer where llama.cpp capped it
        (at the context's cells)."""
        return min(self._batch_tokens, int(self.ll.llama_n_batch(self.ctx)))

    def decode(self) -> int:
        """`llama_decode` over the batch as filled; llama.cpp's status (0: done)."""
        return int(self.ll.llama_decode(self.ctx, self.batch))

    def decode_or_fail(self, what: str) -> None:
        if self.decode() != 0:
            raise EngineUnavailableError(f"llama.cpp failed the {what} decode")

    def logits(self, output: int) -> np.ndarray:
        """The last decode's logits for its `output`th row (a view, valid until the next)."""
        row = self.ll.llama_get_logits_ith(self.ctx, output)
        return np.ctypeslib.as_array(row, (self.vocab.size,))

    # --- LoRA adapters -----------------------------------------------------------------------

    def load_adapter(self, path: Path) -> Any | None:
        """A LoRA adapter of this model (`llama_adapter_lora_init`); None when llama.cpp refuses
        it (another architecture, tensor shapes that do not fit, not a LoRA GGUF: its log says
        which). Freed with the model."""
        handle = self.ll.llama_adapter_lora_init(self.model, str(path).encode())
        return handle or None

    def free_adapter(self, handle: Any) -> None:
        """Free an adapter before the model (`llama_adapter_lora_free`: it leaves the model's
        set and is deleted). The context keeps raw pointers to the adapters set on it, so the
        caller first makes sure it is not applied (`use_adapter(None, ...)`) and that no
        sequence will decode with it again."""
        self.ll.llama_adapter_lora_free(handle)

    def use_adapter(self, handle: Any | None, scale: float) -> None:
        """Apply `handle` at `scale` to every following decode (None: the base model alone).

        llama.cpp keeps the adapter set on the context, not per sequence: a decode computes
        every row with the same set, hence one set per call (scheduler.split_by_adapter)."""
        if handle is None:
            rc = self.ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            handles = (self.ll.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(scale)
            rc = self.ll.llama_set_adapters_lora(self.ctx, handles, 1, scales)
        if rc != 0:
            raise EngineError(f"llama_set_adapters_lora failed with status {rc}")

    # --- KV memory ---------------------------------------------------------------------------

    def forget(self, sid: int, start: int = -1) -> bool:
        """Clear `sid`'s cells from position `start` on (-1: all of them); False when llama.cpp
        cannot cut there (then only clearing all of them works)."""
        return bool(self.ll.llama_memory_seq_rm(self.mem, sid, start, -1))

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        """Give `dst` `src`'s cells at positions [start, end) (-1: unbounded): in one KV pool
        a tag on the same cells, across streams a copy of the stream buffer (deferred to the
        next decode)."""
        self.ll.llama_memory_seq_cp(self.mem, src, dst, start, end)

    # --- at load -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.fill([(max(self.vocab.bos(), 0), 0, 0, True)])
        self.decode_or_fail("warm-up")
        self.forget(0)

    def row_cost(self, extra: int, repeats: int = 5) -> float:
        """What one more output row of the same sequence adds to a one-row decode, as a share
        of it (medians of `repeats`): the price of a speculative draft token on this device.
        On a CPU the output layer of a 262k vocabulary makes it large (~0.25 measured for
        Gemma 3 270M on 2 cores); on a GPU small. Costs 2 x `repeats` decodes, once."""
        one = self.step_seconds(1, repeats)
        more = self.step_seconds(1 + extra, repeats)
        return max(0.0, (more - one) / (extra * one))

    def step_seconds(self, rows: int, repeats: int = 5) -> float:
        """A decode of `rows` rows of sequence 0, each with logits (median of `repeats`);
        sequence 0's cells are cleared after each."""
        first = max(self.vocab.bos(), 0) + 1

        def timed() -> float:
            self.fill([((first + i) % self.vocab.size, i, 0, True) for i in range(rows)])
            began = time.perf_counter()
            self.decode_or_fail("timing probe")
            took = time.perf_counter() - began
            self.forget(0)
            return took

        return statistics.median(timed() for _ in range(repeats))

    def probe_rows(self, widest: int) -> int:
        """The widest decode whose rows come out bit-identical to the same rows decoded alone.

        Each of `widest` sequences gets a short context of its own, then one more token is
        decoded alone (the reference logits) and in batches of 2, 3, … rows: the first width
        whose logits differ from the references ends the probe. Exact batching needs every
        width up to its limit to agree (a step's last group can be any size), so the scan
        stops at the first mismatch. Costs about 2 x widest passes over the weights, once.
        """
        vocab = self.vocab
        first = max(vocab.bos(), 0) + 1

        def token(i: int) -> int:  # distinct tokens, so every row of a batch differs
            return (first + i) % vocab.size

        for sid in range(widest):
            self.fill([(token(sid + i), i, sid, False) for i in range(_PROBE_PREFIX)])
            self.decode_or_fail("probe prefix")
        rows = [(token(100 + sid), _PROBE_PREFIX, sid, True) for sid in range(widest)]
        alone = [self._probe_logits([row])[0] for row in rows]
        agreed = 1
        for width in range(2, widest + 1):
            together = self._probe_logits(rows[:width])
            if any(not np.array_equal(a, b) for a, b in zip(alone, together, strict=False)):
                break
            agreed = width
        for sid in range(widest):
            self.forget(sid)
        return agreed

    def _probe_logits(self, rows: list[Row]) -> list[np.ndarray]:
        """Decode `rows` (one per sequence) in one call; their logits, then forget the rows."""
        self.fill(rows)
        self.decode_or_fail("probe")
        out = [self.logits(i).copy() for i in range(len(rows))]
        for _tok, pos, sid, _want in rows:
            self.forget(sid, pos)
        return out

    # --- chat templates ----------------------------------------------------------------------

    def chat_template(self) -> str | None:
        """The GGUF's `tokenizer.chat_template` (Jinja); None when it has none."""
        template = self.ll.llama_model_chat_template(self.model, None)
        return template.decode() if template else None

    def architecture(self) -> str:
        """The model's `general.architecture` ("" when it has none)."""
        buf = ctypes.create_string_buffer(128)
        n = self.ll.llama_model_meta_val_str(self.model, b"general.architecture", buf, 128)
        return buf.value.decode() if n > 0 else ""

    def builtin_template(self) -> str | None:
        """llama.cpp's built-in template for the model's architecture, where its format is
        certain; None otherwise."""
        arch = self.architecture()
        # llama.cpp's own names (src/llama-chat.cpp); only families whose format is certain.
        for prefix, name in (("gemma", "gemma"), ("qwen", "chatml")):
            if arch.startswith(prefix):
                return name
        return None

    def apply_builtin(self, name: str, messages: list[ChatMessage]) -> str:
        """`messages` through llama.cpp's built-in template `name`, ready for a reply."""
        ll = self.ll
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
