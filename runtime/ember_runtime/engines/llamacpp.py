"""Continuous batching over llama.cpp's low-level API (llama-cpp-python's ctypes bindings).

One context holds `capacity` sequences, each with its own `seq_id`, in one KV pool of
`contextLength x capacity` cells (fast mode) or one KV stream per sequence (deterministic).
A single thread loads the model and runs the decode loop (see `_main` for why one). This
module is the engine that wires the parts together, as llama-server keeps its queue, slots
and sampling apart:

* the request queue: `submit` on the event loop, the pending requests, admission under the
  thermal batch limit (the policy in `engines/scheduler.py`), each request's `Stream`
  (`engines/stream.py`);
* the decode loop: each step's calls (`scheduler.plan_step`), the batch filled and decoded
  (`engines/llama_native.py`, every llama.cpp call), then one token per output row
  (`engines/draw.py`: in `llama_decode` by a device chain, or on the host by
  `engines/sampling.py` with `engines/grammar_mask.py` as the grammar's mask), turned into
  text here; one step's deltas go to the event loop in one `call_soon_threadsafe`;
* the slots: which seq_id a request runs on and the prefix cache (`engines/slots.py`);
* LoRA adapters (`engines/adapters.py`): loaded at start on the shared base, and added or
  removed while serving (`update_adapters`, from the reloaded config); a request naming one is
  decoded with it applied. llama.cpp applies adapters per context, so each step's calls
  are cut per adapter set (`scheduler.split_by_adapter`) and the prefix cache never shares
  cells across adapters (`engines/slots.py`).

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
  bit-identical to single rows *on this CPU* (`LlamaContext.probe_rows`: 7 on the box above;
  another CPU may switch kernels elsewhere or never), each prompt chunk gets its own call cut
  at fixed positions, and repacking and the prefix cache are off (both change kernel shapes).
  The cost: an extra pass over the weights per step from the (exact_rows + 1)th sequence on,
  one prompt chunk per step, no prompt reuse.

KV layout. Fast mode puts every sequence in one pool (`kv_unified`, as llama-server's `-kvu`;
runtime config `engine.kvUnified` can turn it off): any step is one micro-batch whatever its
mix of decode rows and prompt chunks, and a new request shares a running one's computed prompt
cells. Deterministic mode gives every sequence its own stream, so attention never spans another
sequence's (masked) cells, and keeps the running sequences on seq_ids 0..n-1 (`Slots.compact`).
Not covered: a single sequence past 256 tokens of context alone may take llama.cpp's split-KV
attention path, which a batched one does not (not measured).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ember_runtime.contract.config import DEFAULT_CHUNK_TOKENS, DEFAULT_STEP_TOKENS, unified_kv
from ember_runtime.engines import adapters, device_sampling, sampling
from ember_runtime.engines.adapters import AdapterSpec, LoadedAdapter, file_mark
from ember_runtime.engines.base import (
    ChatMessage,
    Delta,
    EngineError,
    EngineInfo,
    EngineState,
    EngineStoppingError,
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
from ember_runtime.engines.device_sampling import DeviceSampling
from ember_runtime.engines.draft import DraftModel, Want
from ember_runtime.engines.draw import Drawer, sampler_pool
from ember_runtime.engines.grammar_mask import Grammar, Grammars
from ember_runtime.engines.llama_native import LlamaContext, NativeLoop, Row, Vocab
from ember_runtime.engines.scheduler import (
    Call,
    Policy,
    admissible,
    decoding,
    plan_step,
    queued,
    split_active,
    split_by_adapter,
)
from ember_runtime.engines.slots import Sequence, Slots
from ember_runtime.engines.speculative import SpecSettings, Speculator
from ember_runtime.engines.stream import Stream, deliver
from ember_runtime.engines.tools import OPEN, builtin_messages, tools_in_messages

log = logging.getLogger(__name__)

# Deterministic mode: the most rows a `llama_decode` may carry is probed at start
# (`LlamaContext.probe_rows`), never assumed: the width at which llama.cpp switches CPU kernels
# depends on the CPU and the build (measured on one 2-core x86 box: logits differ by up to ~1.0
# from 8 rows on, bit-identical for 2..7; another CPU may switch earlier or never). The probe
# tries widths up to this bound; past it a pass over the weights is compute-bound anyway on a
# small edge CPU.
_PROBE_MAX_ROWS = 16
# Speculation: the draft width the row-cost probe times (engines/speculative.py).
_COST_PROBE_ROWS = 4


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
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        deterministic: bool = False,
        prefix_cache: bool | None = None,
        repack: bool | None = None,
        kv_unified: bool | None = None,
        gpu_layers: int = 0,
        sampler_threads: int | None = None,
        device_sampling: DeviceSampling = DeviceSampling.AUTO,
        observer: StepObserver | None = None,
        adapter_specs: Iterable[AdapterSpec] = (),
        speculation: SpecSettings | None = None,
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
        self._observer = observer
        self._max_batch = capacity
        self._cond = threading.Condition()
        self._pending: collections.deque[Sequence] = collections.deque()
        # Both change kernel shapes between a request alone and batched: off when deterministic.
        self._prefix_cache = (not deterministic) if prefix_cache is None else prefix_cache
        self._repack = (not deterministic) if repack is None else repack
        self._deterministic = deterministic
        # Layers in device memory; their KV cache goes with them (llama.cpp's offload_kqv).
        self._gpu_layers = gpu_layers
        # One KV pool for all sequences (llama-server's -kvu): a batch is one micro-batch
        # whatever its mix of sequences; per-sequence streams need equal-length splits.
        # Never in deterministic mode: attention would span other sequences' (masked) cells.
        unified = unified_kv(deterministic, kv_unified)
        # A draft's rows are one sequence's several rows in one call, which llama.cpp's kernels
        # compute differently from one row (its CPU attention takes another path for a lone
        # query): never in deterministic mode, whose promise is a row computed as alone.
        self._spec = None if deterministic else speculation
        self._draft_cost = 1.0  # a draft row's work as a share of a one-row step (at load)
        draft_rows = self._spec.draft_rows if self._spec else 0
        self._native = LlamaContext(
            model_path,
            sequences=capacity,
            sequence_tokens=context_length,
            # A step carries every decode row, its drafts, and up to step_tokens prompt tokens.
            batch_tokens=step_tokens + capacity + draft_rows,
            threads=threads,
            unified=unified,
            gpu_layers=gpu_layers,
            repack=self._repack,
            draft_rows=draft_rows,
            draft_per_sequence=self._spec.max_draft if self._spec else 0,
        )
        self._drafter = (
            DraftModel(
                self._spec.draft_model,
                served=model_path,
                sequences=capacity,
                context_length=context_length,
                threads=threads,
                gpu_layers=gpu_layers,
                repack=self._repack,
            )
            if self._spec is not None and self._spec.draft_model is not None
            else None
        )
        self._slots = Slots(
            self._native, capacity, prefix_cache=self._prefix_cache, unified=unified
        )
        self._policy = Policy(
            deterministic=deterministic, step_tokens=step_tokens, chunk_tokens=chunk_tokens
        )
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_step_sequences = 0
        self._steps = 0
        self._grammars: Grammars | None = None
        self._chat_template: str | None = None
        self._builtin_template: str | None = None
        self._drawer = Drawer(self._native, sampler_pool(threads, sampler_threads))
        self._device_mode = device_sampling
        self._adapter_specs = tuple(adapter_specs)
        # Served ones, by name: replaced whole (never mutated), read by submit on the event loop.
        self._adapters: dict[str, LoadedAdapter] = {}
        # Refused ones: the spec and its file's mark when refused (tried again on a change).
        self._refused: dict[str, tuple[AdapterSpec, tuple[int, int, int] | None]] = {}
        # Removed or re-pointed while serving: freed on the decode thread once no sequence,
        # running or pending, uses them (under _cond).
        self._retiring: list[LoadedAdapter] = []
        # Work for the decode thread between steps (adapter loads), with its caller's future.
        self._ops: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._ops = collections.deque()
        self._applied: LoadedAdapter | None = None  # the adapter the context decodes with now
        self._arch = ""  # the base's general.architecture (at load)

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
        native = self._native
        vocab = native.open()
        self.info.vocab_size = vocab.size
        self._chat_template = native.chat_template()
        self._builtin_template = None if self._chat_template else native.builtin_template()
        if not self._chat_template:
            # Usually a pretrained (base) checkpoint: e.g. the packaged google/gemma-3-270m,
            # which echoes a chat prompt instead of answering it (llama-server does the same).
            # No built-in one either (an architecture llama.cpp has no template for): chat
            # requests are then refused (render_chat), which the log says up front.
            uses = (
                f"chat uses llama.cpp's built-in {self._builtin_template!r} template"
                if self._builtin_template
                else "no built-in template is known for its architecture: chat is refused"
            )
            log.warning(
                "%s has no tokenizer.chat_template (often a base, not instruction-tuned, "
                "model: chat replies will be poor); %s",
                self._path.name,
                uses,
            )
        self._slots.on_device = device_sampling.resolve(
            self._device_mode,
            offloaded=self._gpu_layers > 0 and native.offloads(),
            deterministic=self._deterministic,
        )
        self._arch = native.architecture()
        self._adapters, refused = adapters.load_all(native, self._adapter_specs)
        self._refused = {
            s.name: (s, file_mark(s.path)) for s in self._adapter_specs if s.name in refused
        }
        self.info.adapters = tuple(self._adapters)
        self.info.refused_adapters = refused
        native.warm_up()
        started = time.perf_counter()
        self._grammars = Grammars(vocab)
        self._grammars.risky(OPEN[:1].encode())  # here, not in a decode step that others wait on
        log.info("vocabulary scanned for tool calls in %.2f s", time.perf_counter() - started)
        if self._spec is not None:
            self._draft_cost = self._load_drafting(self._spec, vocab)
        if self._deterministic:
            rows = native.probe_rows(min(self._capacity, _PROBE_MAX_ROWS))
            self._policy = Policy(
                deterministic=True, step_tokens=self._step_tokens, exact_rows=rows
            )
        self._log_ready()

    def _load_drafting(self, spec: SpecSettings, vocab: Vocab) -> float:
        """Load the draft model, if any; a draft token's work as a share of a one-row step:
        its row here, plus the draft model's decode where one drafts."""
        native = self._native
        fixed, probe = spec.row_cost, min(_COST_PROBE_ROWS, spec.max_draft)
        cost = fixed if fixed is not None else native.row_cost(probe)
        source = "the prompt and output"
        if self._drafter is not None:
            self._drafter.open(vocab)
            if fixed is None:
                cost += self._drafter.step_seconds() / native.step_seconds(1)
            source = f"the draft model {self._drafter.path.name}"
        log.info(
            "speculative decoding on, drafts from %s: a draft token costs %.2f of a one-row "
            "step here (a sequence drafts while it keeps more than that share of them)",
            source,
            cost,
        )
        return cost

    def _log_ready(self) -> None:
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
            "supported" if self._native.offloads() else "not built in",
            "in llama_decode where eligible" if self._slots.on_device else "on the host",
        )

    @property
    def exact_rows(self) -> int:
        """Deterministic mode's widest `llama_decode` (probed on this CPU at load); 0 when fast."""
        return self._policy.exact_rows if self._deterministic else 0

    @property
    def device_rows(self) -> int:
        """Tokens drawn inside llama_decode (device chains) so far."""
        return self._drawer.device_rows

    @property
    def vocab(self) -> Vocab:
        """The model's vocabulary (once started)."""
        return self._native.vocab

    @property
    def grammars(self) -> Grammars:
        """The grammars requests are constrained by, over this model's vocabulary (once
        started)."""
        if self._grammars is None:
            raise EngineError("the engine has not started")
        return self._grammars

    def _free(self) -> None:
        self._drawer.close()
        if self._native.ll is None:
            return
        self._slots.close(self._steps)
        self._native.close()
        if self._drafter is not None:
            self._drafter.close()

    # --- the Engine API (event loop side) ----------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self._native.vocab.tokenize(text, add_special=add_special)

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
        vocab = self._native.vocab
        bos = vocab.special_text(vocab.bos())
        if template is not None:
            eos = vocab.special_text(vocab.eos())
            return render_template(template, messages, bos_token=bos, eos_token=eos, tools=tools)
        if self._builtin_template is None:
            raise ValueError("the model has no chat template and no built-in one is known")
        return bos + self._native.apply_builtin(self._builtin_template, messages)

    def submit(self, prompt: list[int], params: SamplingParams) -> Stream:
        if not prompt:
            raise ValueError("the prompt is empty")
        lora = None
        if params.adapter is not None:
            lora = self._adapters.get(params.adapter)
            if lora is None:
                raise InvalidRequestError(f"adapter {params.adapter} is not served", param="model")
        stream = Stream(self._wake, len(prompt))
        with self._cond:
            if self._stopping:
                raise EngineStoppingError("the engine is shutting down")
            waiting = queued(
                len(self._slots.running), len(self._pending), self._max_batch, self._slots.free
            )
            if waiting >= self._max_queue:
                raise QueueFullError(waiting)
        # Built here, on the event loop, so a grammar that llama.cpp cannot parse is the
        # client's 400 rather than an error delta later (it only reads the vocabulary).
        sampler, grammar = self._make_sampler(prompt, params)
        seq = Sequence(stream, prompt, params, sampler, grammar)
        seq.lora = lora  # this version, even if the adapter is removed while it runs
        with self._cond:
            self._pending.append(seq)
            self._cond.notify()
        return stream

    # --- LoRA adapters while serving (event loop side) ---------------------------------------

    async def update_adapters(self, specs: Iterable[AdapterSpec]) -> bool:
        """Serve what `specs` lists, without touching the base or running requests: a new
        (or re-pointed) adapter is checked (sha256, header: on a worker thread) and loaded by
        llama.cpp on the decode thread between two steps, so running streams wait for that
        load only; a removed one is no longer served (new requests naming it get 404: the
        server's `removed_adapters`) while requests already running on it finish with it, and
        its handle is freed once no running or queued request uses it. A refused one is tried
        again on a later call once its file changed (e.g. it arrived). Returns whether
        anything changed. One caller at a time (the server's reload loop)."""
        wanted = {s.name: s for s in specs}
        served = self._adapters
        drop = [n for n, a in served.items() if wanted.get(n) != a.spec]
        gone = [n for n in self._refused if n not in wanted]
        load = []
        for name, spec in wanted.items():
            current = served.get(name)
            if current is not None and current.spec == spec:
                continue
            refused = self._refused.get(name)
            if refused is not None and refused == (spec, file_mark(spec.path)):
                continue  # refused already, and its file has not changed since
            load.append(spec)
        if not (drop or gone or load):
            return False
        checked = []
        for spec in load:  # hashing a file takes a while: never on the decode thread
            mark = file_mark(spec.path)
            reason = await asyncio.to_thread(adapters.refusal, spec, self._arch)
            checked.append((spec, reason, mark))

        def load_checked() -> dict[str, LoadedAdapter | str]:
            return {s.name: adapters.load_checked(self._native, s, r) for s, r, _ in checked}

        results = await self._on_decode_thread(load_checked) if checked else {}
        now = {n: a for n, a in served.items() if n not in drop}
        refused_now = dict(self.info.refused_adapters)
        for name in gone:
            refused_now.pop(name, None)
            self._refused.pop(name, None)
        for spec, _reason, mark in checked:
            got = results[spec.name]
            if isinstance(got, str):
                refused_now[spec.name] = got
                self._refused[spec.name] = (spec, mark)
            else:
                now[spec.name] = got
                refused_now.pop(spec.name, None)
                self._refused.pop(spec.name, None)
        self._adapters = {n: now[n] for n in wanted if n in now}
        removed = set(self.info.removed_adapters) | {n for n in (*drop, *gone) if n not in wanted}
        self.info.removed_adapters = frozenset(removed - set(wanted))
        self.info.adapters = tuple(self._adapters)
        self.info.refused_adapters = refused_now
        retired = [served[n] for n in drop]
        if retired:
            with self._cond:
                self._retiring.extend(retired)
                self._cond.notify()
        log.info(
            "LoRA adapters now served: %s (refused: %s)",
            ", ".join(self._adapters) or "none",
            ", ".join(refused_now) or "none",
        )
        return True

    async def _on_decode_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the decode thread between two steps; its result."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise EngineStoppingError("the engine is shutting down")
            self._ops.append((fn, done))
            self._cond.notify()
        return await asyncio.wrap_future(done)

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
            active=len(self._slots.running),
            queued=len(self._pending),
            last_step_sequences=self._last_step_sequences,
            steps=self._steps,
        )

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _make_sampler(
        self, prompt: list[int], params: SamplingParams
    ) -> tuple[sampling.RowSampler, Grammar | None]:
        """The numpy sampler for a request, with llama.cpp's grammar as its mask (if any)."""
        grammar = None
        if params.grammar is not None:
            grammar = self.grammars.compile(params.grammar, free_until=params.grammar_free_until)
        eog = self._native.vocab.eog_tokens() if params.ignore_eos else ()
        row = sampling.RowSampler(
            params, prompt, eog_tokens=eog, grammar=grammar.mask if grammar else None
        )
        return row, grammar

    # --- the request queue (decode thread) ---------------------------------------------------

    def _run(self) -> None:
        try:
            while self._schedule():
                self._run_ops()
                if self._slots.running:
                    self._step()
                self._free_retired()
        except Exception:  # a bug here must not leave clients hanging forever
            log.exception("decode loop crashed")
            self._fail_all("the decode loop crashed")
        finally:
            self._fail_all("the engine stopped")
            self._cancel_ops()

    def _run_ops(self) -> None:
        """The work handed to the decode thread (adapter loads), between two steps."""
        while True:
            with self._cond:
                if not self._ops:
                    return
                fn, done = self._ops.popleft()
            try:
                done.set_result(fn())
            except Exception as exc:  # the caller's to handle; the loop goes on
                done.set_exception(exc)

    def _cancel_ops(self) -> None:
        with self._cond:
            ops, self._ops = list(self._ops), collections.deque()
        for _fn, done in ops:
            done.set_exception(EngineStoppingError("the engine stopped"))

    def _free_retired(self) -> None:
        """Free each removed adapter no running or queued request uses any more (llama.cpp's
        `llama_adapter_lora_free`; unset from the context first, which keeps raw pointers)."""
        with self._cond:
            if not self._retiring:
                return
            used = {id(s.lora) for s in self._pending if s.lora is not None}
            retiring = list(self._retiring)
        used |= {id(s.lora) for s in self._slots.running if s.lora is not None}
        freed = [a for a in retiring if id(a) not in used]
        for lora in freed:
            if self._applied is lora:
                self._native.use_adapter(None, 0.0)
                self._applied = None
            self._native.free_adapter(lora.handle)
            log.info("LoRA adapter %s (%s) freed", lora.spec.name, lora.spec.sha256[:12])
        if freed:
            with self._cond:
                self._retiring = [a for a in self._retiring if a not in freed]

    @property
    def retiring_adapters(self) -> int:
        """Removed adapters still held for the requests that use them."""
        with self._cond:
            return len(self._retiring)

    def _schedule(self) -> bool:
        """Wait for work, drop cancelled requests, admit new ones; False when stopping."""
        slots = self._slots
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._stopping:
                    return False
                joining = admissible(
                    len(slots.running), len(self._pending), self._max_batch, slots.free
                )
                self._admit_some(joining)
                if slots.running:
                    slots.compact(self._steps)
                    return True
                if self._ops or self._retiring:  # idle: nothing uses a retired adapter now
                    return True
                self._cond.wait()

    def _drop_cancelled(self) -> None:
        if any(s.stream.cancelled for s in self._pending):
            kept = [s for s in self._pending if not s.stream.cancelled]
            for seq in self._pending:
                if seq.stream.cancelled:
                    seq.drop_sampler()
            self._pending.clear()
            self._pending.extend(kept)
        done = [s for s in self._slots.running if s.stream.cancelled]
        for seq in done:
            self._finish(seq, Delta("", 0, FinishReason.CANCELLED), deliver_now=True)

    def _admit_some(self, joining: int) -> None:
        """Admit up to `joining` pending requests in order, holding back one whose prompt a
        running request is still computing (the samples of an `n` > 1 request, or a retry):
        once that prompt is in the KV pool it is shared, and only the last token is decoded
        again, instead of every copy computing the whole prompt."""
        held: list[Sequence] = []
        while joining and self._pending:
            seq = self._pending.popleft()
            if self._slots.computing(seq.prompt, seq.adapter):
                held.append(seq)
                continue
            self._slots.admit(seq)
            joining -= 1
        self._pending.extendleft(reversed(held))

    # --- one step (decode thread) ------------------------------------------------------------

    def _step(self) -> None:
        """One scheduling step: the calls `plan_step` chose, each decoded then sampled."""
        active, _paused = split_active(self._slots.running, self._max_batch)
        active.sort(key=lambda seq: seq.seq_id)  # consecutive ids: one ubatch (Slots.compact)
        began = time.perf_counter()
        prompt_tokens = 0
        drafted = self._draft(active)
        accepted = 0
        # One adapter set per llama_decode (llama.cpp's adapters are the context's).
        for call in split_by_adapter(plan_step(active, self._policy), _adapter_of):
            self._apply_adapter(call)
            rows, outputs = _rows_of(call)
            self._native.fill(rows)
            prompt_tokens += call.rows - len(call.decodes)
            rc = self._native.decode()
            if rc != 0:
                self._fail_batch(active, f"llama_decode failed with status {rc}")
                return
            accepted += self._sample(outputs)
        self._steps += 1
        self._last_step_sequences = len(active)
        if self._observer is not None:
            took = time.perf_counter() - began
            self._observer(StepStats(took, len(active), prompt_tokens, drafted, accepted))

    def _draft(self, active: list[Sequence]) -> int:
        """Each decoding sequence's draft for this step, within the step's draft rows (taken
        in turn from a different sequence each step); the tokens drafted."""
        spec = self._spec
        if spec is None:
            return 0
        budget = spec.draft_rows
        sharing = sum(decoding(s) for s in active)
        start = self._steps % len(active) if active else 0
        wants: list[tuple[Sequence, int]] = []
        for seq in active[start:] + active[:start]:
            if seq.spec is None or not decoding(seq):
                continue
            done = seq.prefilled + seq.generated  # the cells in use after this step's row
            room = min(seq.params.max_tokens - seq.generated - 1, self.info.context_length - done)
            if self._drafter is None:  # a lookup: its length is known now
                seq.draft = seq.spec.propose(seq.generated, min(room, budget), sharing)
                budget -= len(seq.draft)
            elif count := seq.spec.wanted(seq.generated, min(room, budget), sharing):
                wants.append((seq, count))  # the draft model's, for all of them at once
                budget -= count
        if wants and self._drafter is not None:
            drafts = self._drafter.draft(
                [Want(s.seq_id, s, s.spec.index.tokens, n) for s, n in wants if s.spec]
            )
            for seq, _ in wants:
                seq.draft = drafts[seq.seq_id]
        return sum(len(seq.draft) for seq in active)

    def _apply_adapter(self, call: Call[Sequence]) -> None:
        """Set the call's adapter on the context when it is not the one applied already (the
        version each request was submitted for: `Sequence.lora`)."""
        loaded = (call.decodes[0] if call.decodes else call.chunks[0].seq).lora
        if loaded is self._applied:
            return
        if loaded is None:  # the base alone
            self._native.use_adapter(None, 0.0)
        else:
            self._native.use_adapter(loaded.handle, loaded.scale)
        self._applied = loaded

    def _sample(self, outputs: list[tuple[Sequence, int]]) -> int:
        """Each output's tokens to its stream; the draft tokens kept (speculation)."""
        emits: list[tuple[Stream, Delta]] = []
        kept = 0
        drafted = [(seq, first) for seq, first in outputs if seq.draft]
        if drafted:
            outputs = [(seq, first) for seq, first in outputs if not seq.draft]
            for seq, first in drafted:
                delta, n = self._verify(seq, first)
                kept += n
                emits.append((seq.stream, delta))
                if delta.finish_reason is not None:
                    self._slots.release(seq, self._steps)
        for seq, tok, row in self._drawer.tokens(outputs):
            seq.sampler.accept(tok)
            if seq.grammar is not None:
                seq.grammar.accept(tok)
            if seq.chain is not None:
                seq.chain.accept(tok)
            delta = self._advance(seq, tok, row)
            if delta is not None:
                emits.append((seq.stream, delta))
                if delta.finish_reason is not None:
                    self._slots.release(seq, self._steps)
        if emits and self._loop is not None:
            self._loop.call_soon_threadsafe(deliver, emits)
        return kept

    def _verify(self, seq: Sequence, first: int) -> tuple[Delta, int]:
        """Draw each of a drafted sequence's rows in turn with its own sampler: the draft's
        tokens are kept while the drawn token equals them, the first that differs is kept as
        the correction (engines/speculative.py says why the distribution is the target's).
        The cells of the draft tokens not kept are cleared. One merged delta, and the number
        of draft tokens kept."""
        draft, seq.draft = seq.draft, []
        pos = seq.prefilled + seq.generated - 1  # the last token's cell; the draft's follow
        deltas: list[Delta] = []
        kept = 0
        for i in range(len(draft) + 1):
            row = self._native.logits(first + i)
            tok = sampling.greedy(row) if seq.sampler.plain_greedy else seq.sampler.sample(row)
            seq.sampler.accept(tok)
            delta = self._advance(seq, tok, row)
            deltas.append(delta)
            if delta.finish_reason is not None or i == len(draft) or tok != draft[i]:
                break
            kept += 1
        if seq.spec is not None:
            seq.spec.record(len(draft), kept, seq.generated)
        if deltas[-1].finish_reason is None and kept < len(draft):
            self._native.forget(seq.seq_id, pos + kept + 1)
        return _merged(deltas), kept

    def _advance(self, seq: Sequence, tok: int, row: np.ndarray | None) -> Delta:
        vocab = self._native.vocab
        seq.last_token = tok
        self._track(seq, tok)
        if vocab.is_eog(tok):
            return Delta(seq.text.flush(), 0, FinishReason.STOP)
        seq.generated += 1
        text, stopped = seq.text.push(vocab.piece(tok))
        top = seq.params.logprobs
        lp = () if top is None or row is None else (self._logprob(row, tok, top),)
        if stopped:
            return Delta(text, 1, FinishReason.STOP, logprobs=lp)
        full = seq.prefilled + seq.generated >= self.info.context_length
        if seq.generated >= seq.params.max_tokens or full:
            return Delta(text + seq.text.flush(), 1, FinishReason.LENGTH, logprobs=lp)
        return Delta(text, 1, logprobs=lp)

    def _track(self, seq: Sequence, tok: int) -> None:
        """The generated token into the sequence's draft index; the index is made at its first
        token where it may draft (host-sampled, no grammar, asked for more than one token)."""
        if seq.spec is not None:
            seq.spec.index.append(tok)
        elif (
            seq.generated == 0
            and self._spec is not None
            and seq.params.speculative
            and seq.params.max_tokens > 1
            and seq.chain is None
            and seq.grammar is None
        ):
            seq.spec = Speculator([*seq.prompt, tok], self._spec, self._draft_cost)

    def _logprob(self, row: np.ndarray, tok: int, top: int) -> TokenLogprob:
        chosen, best = sampling.logprobs(row, tok, top)
        alternatives = tuple(TopLogprob(*self._token_text(t), lp) for t, lp in best)
        return TokenLogprob(*self._token_text(tok), chosen, alternatives)

    def _token_text(self, tok: int) -> tuple[str, bytes]:
        piece = self._native.vocab.piece(tok)
        return piece.decode("utf-8", "replace"), piece

    # --- ending requests (decode thread) -----------------------------------------------------

    def _finish(self, seq: Sequence, delta: Delta, *, deliver_now: bool) -> None:
        self._slots.release(seq, self._steps)
        if deliver_now and self._loop is not None:
            self._loop.call_soon_threadsafe(seq.stream.put, delta)

    def _fail_batch(self, seqs: list[Sequence], message: str) -> None:
        log.error("%s; failing %d sequence(s)", message, len(seqs))
        for seq in list(seqs):
            seq.prefilled = 0  # the cache state is unknown now: keep nothing for reuse
            self._finish(seq, Delta("", 0, FinishReason.ERROR, message), deliver_now=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self._pending) + list(self._slots.running)
            self._pending.clear()
        for seq in waiting:
            delta = Delta("", 0, FinishReason.CANCELLED, message)
            if seq.seq_id >= 0:
                self._finish(seq, delta, deliver_now=True)
            else:
                seq.drop_sampler()
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(seq.stream.put, delta)


def _adapter_of(seq: Sequence) -> str | None:
    return seq.adapter


def _merged(deltas: list[Delta]) -> Delta:
    """One step's deltas of one sequence (a verified draft) as one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(
        "".join(d.text for d in deltas),
        sum(d.n_tokens for d in deltas),
        last.finish_reason,
        last.error,
        tuple(lp for d in deltas for lp in d.logprobs),
    )


def _rows_of(call: Call[Sequence]) -> tuple[list[Row], list[tuple[Sequence, int]]]:
    """One call's batch rows, and (sequence, first output row) for each sequence to sample (a
    drafted one's draft rows follow its first). Marks the prompt tokens it carries as
    submitted."""
    rows: list[Row] = []
    outputs: list[tuple[Sequence, int]] = []
    for seq in call.decodes:
        outputs.append((seq, len(rows)))
        pos = seq.prefilled + seq.generated - 1  # the last sampled token's position
        rows.append((seq.last_token, pos, seq.seq_id, True))
        for i, tok in enumerate(seq.draft):
            rows.append((tok, pos + 1 + i, seq.seq_id, True))
    for chunk in call.chunks:
        seq, last = chunk.seq, chunk.start + chunk.count - 1
        for i in range(chunk.start, last + 1):
            rows.append((seq.prompt[i], i, seq.seq_id, False))
        if chunk.completes_prompt:
            outputs.append((seq, len(rows) - 1))
            rows[-1] = (seq.prompt[last], last, seq.seq_id, True)
        seq.prefilled = last + 1
    return rows, outputs
