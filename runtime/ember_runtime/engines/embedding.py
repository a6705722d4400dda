"""Embeddings through llama.cpp (the engine of a `model.task: embed` deployment).

One context with `embeddings=True` and a pooling type (the spec's `model.pooling`, else the
GGUF's `<arch>.pooling_type`) turns each input into one vector. Inputs of every waiting request
share a `llama_decode`, one `seq_id` each, up to the thermal batch limit and `contextLength`
tokens per call (the whole call is one micro-batch, which non-causal encoders such as BERT
need); llama.cpp pools each sequence on its own, and the KV cells are cleared after each call.
Identical inputs in one call are computed once: the same tokens at another row of a batch
round differently in llama.cpp's CPU kernels (cosine 0.99997 on Gemma 3 270M), and a client
comparing two equal texts must get equal vectors. Vectors are L2-normalised, as OpenAI's and
llama-server's are.

Like the generation engine, one thread loads the model and runs every decode (OpenMP's worker
teams are per calling thread: engines/llamacpp.py `_main` says why that matters); the native
calls both engines make are engines/llama_native.py's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ember_runtime.engines.base import (
    ChatMessage,
    EngineError,
    EngineInfo,
    EngineState,
    EngineStoppingError,
    EngineUnavailableError,
    GenerationStream,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    StepObserver,
    StepStats,
)
from ember_runtime.engines.llama_native import (
    NativeLoop,
    fill_batch,
    free_native,
    load_model,
    tokenize,
)
from ember_runtime.gguf_header import read_header

log = logging.getLogger(__name__)

POOLING_NAMES = {1: "mean", 2: "cls", 3: "last"}  # llama_pooling_type values that give one vector
_NOT_ONE_VECTOR = {0: "none", 4: "rank"}
_NOT_GENERATING = "this deployment serves embeddings (model.task embed): use /v1/embeddings"


def check_pooling(model: Path, pooling: str | None) -> str:
    """The pooling a model will embed with: `pooling`, else its GGUF's `<arch>.pooling_type`.
    Raises ValueError, saying what to set, when that gives no single vector per input. Read
    from the header before the model loads, so the pod's termination message carries it."""
    if pooling is not None:
        return pooling
    header = read_header(model)
    key = f"{header.get('general.architecture', '')}.pooling_type"
    kind = header.get(key, 0)  # llama.cpp's default when the key is absent: none
    if isinstance(kind, int) and kind in POOLING_NAMES:
        return POOLING_NAMES[kind]
    what = _NOT_ONE_VECTOR.get(kind, str(kind)) if isinstance(kind, int) else str(kind)
    raise ValueError(
        f"{model.name}: the GGUF's {key} is {what!r}"
        f"{' (absent: a generative model names none)' if key not in header else ''}, which "
        "gives no vector per input; set spec.model.pooling to mean, cls or last"
    )


@dataclass(eq=False)
class Job:
    """One request's inputs on their way through the decode thread."""

    inputs: list[list[int]]
    future: concurrent.futures.Future[list[np.ndarray]] = field(
        default_factory=concurrent.futures.Future
    )
    results: list[np.ndarray | None] = field(default_factory=list)
    planned: int = 0  # inputs handed to a decode so far (they go in order)
    done: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)


def plan_step(pending: Iterable[Job], max_seqs: int, max_tokens: int) -> list[tuple[Job, int]]:
    """The inputs of one decode, oldest first: at most `max_seqs` distinct inputs and
    `max_tokens` tokens (a repeated input costs nothing: it shares its twin's sequence).
    Stops at the first input that does not fit, so requests are served in arrival order."""
    items: list[tuple[Job, int]] = []
    distinct: set[tuple[int, ...]] = set()
    tokens = 0
    for job in pending:
        for i in range(job.planned, len(job.inputs)):
            key = tuple(job.inputs[i])
            if key not in distinct:
                if len(distinct) == max_seqs or tokens + len(key) > max_tokens:
                    return items
                distinct.add(key)
                tokens += len(key)
            items.append((job, i))
    return items


class LlamaCppEmbedder(NativeLoop):
    """The `Engine` (and `Embedder`) for GGUF embedding through llama.cpp."""

    def __init__(
        self,
        model_path: Path,
        *,
        context_length: int,
        capacity: int,
        threads: int,
        max_queue: int,
        pooling: str | None = None,
        model_id: str | None = None,
        gpu_layers: int = 0,
        observer: StepObserver | None = None,
    ) -> None:
        if not 1 <= capacity <= 256:
            raise ValueError(f"capacity must be within 1..256, got {capacity}")
        if pooling is not None and pooling not in POOLING_NAMES.values():
            raise ValueError(f"pooling must be one of {sorted(POOLING_NAMES.values())}")
        self.info = EngineInfo(
            name="llamacpp",
            model_id=model_id or model_path.stem,
            context_length=context_length,
            task="embed",
        )
        self._path = model_path
        self._capacity = capacity
        self._threads = threads
        self._max_queue = max_queue
        self._pooling = pooling
        self._gpu_layers = gpu_layers
        self._observer = observer
        self._max_batch = capacity
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._last_step_sequences = 0
        self._active = 0
        self._dimensions = 0
        self._ll: Any = None
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._mem: Any = None
        self._batch: Any = None

    @property
    def dimensions(self) -> int:
        return self._dimensions

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(loaded,), name="ember-embed", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(loaded)

    def _main(self, loaded: concurrent.futures.Future[None]) -> None:
        try:
            self._load()
        except BaseException as exc:  # handed to start()'s caller, whatever it is
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        try:
            while (items := self._take()) is not None:
                self._step(items)
        except Exception:  # a bug here must not leave clients waiting forever
            log.exception("embedding loop crashed")
        finally:
            self._fail_pending(EngineStoppingError("the engine stopped"))

    def _load(self) -> None:
        self._ll, self._model = load_model(self._path, gpu_layers=self._gpu_layers, repack=True)
        ll = self._ll
        self._ctx = ll.llama_init_from_model(self._model, self._context_params(ll))
        if not self._ctx:
            raise EngineUnavailableError("llama.cpp could not create a context (memory?)")
        self.info.extra["pooling"] = self._resolved_pooling()
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.info.vocab_size = ll.llama_vocab_n_tokens(self._vocab)
        self._dimensions = ll.llama_model_n_embd(self._model)
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(self.info.context_length, 0, 1)
        log.info(
            "llama.cpp embedding engine ready: %s, %d dimensions, %s pooling (%s), up to %d "
            "inputs and %d tokens per decode, %d thread(s)",
            self._path.name,
            self._dimensions,
            self.info.extra["pooling"],
            "from the spec" if self._pooling else "from the GGUF",
            self._capacity,
            self.info.context_length,
            self._threads,
        )

    def _context_params(self, ll: Any) -> Any:
        cparams = ll.llama_context_default_params()
        # One call holds up to contextLength tokens over all its sequences, in one micro-batch,
        # in one KV pool (cleared after each call), so any single input may use all of it.
        cparams.n_ctx = self.info.context_length
        cparams.n_batch = self.info.context_length
        cparams.n_ubatch = self.info.context_length
        cparams.n_seq_max = self._capacity
        cparams.kv_unified = True
        cparams.embeddings = True
        names = {name: value for value, name in POOLING_NAMES.items()}
        cparams.pooling_type = (
            names[self._pooling] if self._pooling else ll.LLAMA_POOLING_TYPE_UNSPECIFIED
        )
        cparams.n_threads = self._threads
        cparams.n_threads_batch = self._threads
        cparams.no_perf = True
        return cparams

    def _resolved_pooling(self) -> str:
        kind = int(self._ll.llama_pooling_type(self._ctx))
        if kind in POOLING_NAMES:
            return POOLING_NAMES[kind]
        what = _NOT_ONE_VECTOR.get(kind, str(kind))
        raise EngineUnavailableError(
            f"{self._path.name}: the GGUF's pooling type is {what!r} (a generative model's "
            "GGUF names none), which gives no vector per input; set spec.model.pooling to "
            "mean, cls or last"
        )

    def _free(self) -> None:
        ll = self._ll
        if ll is None:
            return
        free_native(ll, self._batch, self._ctx, self._model)
        self._batch = self._ctx = self._model = None

    # --- the Engine API (event loop side) ----------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return tokenize(self._ll, self._vocab, text, add_special=add_special)

    def render_chat(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        raise InvalidRequestError(_NOT_GENERATING, param="model")

    def submit(self, prompt: list[int], params: SamplingParams) -> GenerationStream:
        raise InvalidRequestError(_NOT_GENERATING, param="model")

    def embed(self, inputs: list[list[int]]) -> asyncio.Future[list[np.ndarray]]:
        job = Job(inputs)
        with self._cond:
            if self._stopping:
                raise EngineStoppingError("the engine is shutting down")
            if len(self._pending) >= self._max_queue:
                raise QueueFullError(len(self._pending))
            self._pending.append(job)
            self._cond.notify()
        return asyncio.wrap_future(job.future)

    def set_max_batch_size(self, n: int) -> None:
        if not 1 <= n <= self._capacity:
            raise ValueError(f"maxBatchSize must be within 1..{self._capacity}, got {n}")
        with self._cond:
            self._max_batch = n

    def state(self) -> EngineState:
        return EngineState(
            max_batch_size=self._max_batch,
            capacity=self._capacity,
            active=self._active,
            queued=len(self._pending),
            last_step_sequences=self._last_step_sequences,
            steps=self._steps,
        )

    # --- the decode loop (its own thread) --------------------------------------------------

    def _take(self) -> list[tuple[Job, int]] | None:
        """The next decode's inputs (waiting for some); None when stopping."""
        with self._cond:
            while True:
                while self._pending and self._pending[0].future.cancelled():
                    self._pending.popleft()
                if self._stopping:
                    return None
                live = [job for job in self._pending if not job.future.cancelled()]
                items = plan_step(live, self._max_batch, self.info.context_length)
                if items:
                    for job, i in items:
                        job.planned = i + 1
                    while self._pending and self._pending[0].planned == len(
                        self._pending[0].inputs
                    ):
                        self._pending.popleft()
                    return items
                self._cond.wait()

    def _step(self, items: list[tuple[Job, int]]) -> None:
        started = time.perf_counter()
        seq_of: dict[tuple[int, ...], int] = {}
        for job, i in items:
            seq_of.setdefault(tuple(job.inputs[i]), len(seq_of))
        self._active = len(seq_of)
        try:
            vectors = self._decode(seq_of)
        except Exception as exc:  # every waiting request hears of it, whatever it was
            log.exception("embedding decode failed")
            error = exc if isinstance(exc, EngineError) else EngineError(f"decode failed: {exc}")
            for job, _i in items:
                _settle(job, error)
            return
        finally:
            self._active = 0
        # Counted before any reply goes out: a client that reads state() after its answer
        # must see the step that computed it.
        self._steps += 1
        self._last_step_sequences = len(seq_of)
        if self._observer is not None:
            tokens = sum(len(key) for key in seq_of)
            self._observer(StepStats(time.perf_counter() - started, len(seq_of), tokens))
        for job, i in items:
            job.results[i] = vectors[seq_of[tuple(job.inputs[i])]]
            job.done += 1
            if job.done == len(job.inputs):
                _settle(job, [r for r in job.results if r is not None])

    def _decode(self, seq_of: dict[tuple[int, ...], int]) -> list[np.ndarray]:
        """One `llama_decode` over the distinct inputs; their normalised vectors by seq_id."""
        ll = self._ll
        # Every token outputs: pooling reads them all.
        rows = [
            (tok, pos, sid, True)
            for tokens, sid in seq_of.items()
            for pos, tok in enumerate(tokens)
        ]
        fill_batch(self._batch, rows)
        try:
            if ll.llama_decode(self._ctx, self._batch) != 0:
                raise EngineError("llama.cpp failed to decode the inputs")
            return [self._pooled(sid) for sid in range(len(seq_of))]
        finally:
            ll.llama_memory_clear(self._mem, True)

    def _pooled(self, sid: int) -> np.ndarray:
        ptr = self._ll.llama_get_embeddings_seq(self._ctx, sid)
        if not ptr:
            raise EngineError(f"llama.cpp returned no embedding for sequence {sid}")
        vec = np.ctypeslib.as_array(ptr, (self._dimensions,)).astype(np.float32)  # a copy
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def _fail_pending(self, exc: EngineError) -> None:
        with self._cond:
            jobs = list(self._pending)
            self._pending.clear()
        for job in jobs:
            _settle(job, exc)


def _settle(job: Job, outcome: list[np.ndarray] | BaseException) -> None:
    """Resolve a job's future unless its request gave up (cancelled) meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)
