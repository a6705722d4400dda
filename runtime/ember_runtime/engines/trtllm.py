"""A thin adapter over TensorRT-LLM's public `LLM` API (`generate_async(..., streaming=True)`).

TensorRT-LLM batches in flight on the GPU itself, so this adapter only maps our request and
stream types onto its own, and enforces the admin batch limit with an admission gate. It is
imported lazily: on a machine without TensorRT-LLM or a GPU, `start()` fails with a clear
message instead of the import failing at module load.

Checked against TensorRT-LLM's own sources (`tensorrt_llm/sampling_params.py`,
`executor/result.py`, `llmapi/llm.py`): `generate_async(token_ids, sampling_params=...,
streaming=True)` returns a `RequestOutput` that is its own async iterator; each step's
`outputs[0]` carries `text_diff`, `token_ids_diff` and, once `finished`, a `finish_reason` in
{stop, length, timeout, cancelled}. It raises at once (ValueError, RuntimeError) for a prompt that
does not fit or an LLM that is shutting down; those become an ERROR delta, not a crashed stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ember_runtime.engines.base import (
    ChatMessage,
    Delta,
    EngineInfo,
    EngineState,
    EngineStoppingError,
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    SamplingParams,
)
from ember_runtime.engines.chat import template_message
from ember_runtime.engines.text import TextAssembler
from ember_runtime.engines.tools import builtin_messages, tools_in_messages

log = logging.getLogger(__name__)

# CompletionOutput.finish_reason -> ours. "timeout" is TensorRT-LLM's own per-request limit
# (we never set one); the client did not cancel, but the request did not complete either.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
    "timeout": FinishReason.ERROR,
}


def _gpu_count() -> int:
    try:
        import pynvml  # noqa: PLC0415 - optional, GPU nodes only
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return 0
    return count


class _TrtStream:
    __slots__ = ("_engine", "_handle", "_params", "_prompt", "cancelled")

    def __init__(self, engine: TrtLlmEngine, prompt: list[int], params: SamplingParams) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._handle: Any = None
        self.cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        async with self._engine._slot():
            if self.cancelled:
                yield Delta("", 0, FinishReason.CANCELLED)
                return
            text = TextAssembler(self._params.stop)
            try:
                self._handle = self._engine._generate(self._prompt, self._params)
                async for output in self._handle:
                    delta = _delta(output, text)
                    if delta.finish_reason is not None and not output.finished:
                        self._handle.abort()  # our stop string hit: free the GPU slot
                    yield delta
                    if delta.finish_reason is not None:
                        return
            except (ValueError, RuntimeError) as exc:  # rejected request, executor failure
                yield Delta("", 0, FinishReason.ERROR, f"TensorRT-LLM: {exc}")
                return
            # The iterator ended without a final output (the LLM was shut down under us).
            yield Delta("", 0, FinishReason.CANCELLED, "TensorRT-LLM stopped the request")

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self._handle is not None and not self._handle.finished:
            self._handle.abort()


def _delta(output: Any, text: TextAssembler) -> Delta:
    """One streamed `RequestOutput` step as a Delta; stop strings are matched here, on text."""
    out = output.outputs[0]
    n_tokens = len(out.token_ids_diff)
    piece, stopped = text.push(out.text_diff.encode())
    if stopped:
        return Delta(piece, n_tokens, FinishReason.STOP)
    if not output.finished:
        return Delta(piece, n_tokens)
    reason = _FINISH.get(str(out.finish_reason), FinishReason.ERROR)
    error = None
    if reason is FinishReason.ERROR:
        error = f"TensorRT-LLM finished the request with reason {out.finish_reason!r}"
    return Delta(piece + text.flush(), n_tokens, reason, error)


class TrtLlmEngine:
    def __init__(
        self,
        engine_dir: Path,
        *,
        context_length: int,
        capacity: int,
        max_queue: int,
        model_id: str | None = None,
    ) -> None:
        self.info = EngineInfo(
            name="tensorrt-llm", model_id=model_id or engine_dir.name, context_length=context_length
        )
        self._dir = engine_dir
        self._capacity = capacity
        self._max_batch = capacity
        self._max_queue = max_queue
        self._llm: Any = None
        self._sampling_cls: Any = None
        self._active = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._stopping = False

    async def start(self) -> None:
        try:
            import tensorrt_llm  # noqa: PLC0415 - optional, GPU nodes only
        except ImportError as exc:
            raise EngineUnavailableError(
                "engine kind 'tensorrt-llm' needs the tensorrt_llm package and an NVIDIA GPU; "
                f"install ember[tensorrt-llm] on a GPU node ({exc})"
            ) from exc
        if _gpu_count() == 0:
            raise EngineUnavailableError("engine kind 'tensorrt-llm' found no NVIDIA GPU (NVML)")
        if not self._dir.is_dir():
            raise EngineUnavailableError(f"TensorRT-LLM engine directory not found: {self._dir}")
        llm_cls = tensorrt_llm.LLM
        if any(self._dir.glob("*.engine")):  # a prebuilt TensorRT engine, not a checkpoint
            from tensorrt_llm._tensorrt_engine import LLM as EngineLLM  # noqa: PLC0415

            llm_cls = EngineLLM
        self._sampling_cls = tensorrt_llm.SamplingParams
        self._llm = await asyncio.to_thread(llm_cls, model=str(self._dir))
        log.info("TensorRT-LLM engine ready: %s", self._dir)

    async def stop(self) -> None:
        self._stopping = True
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        ids: list[int] = self._llm.tokenizer.encode(text, add_special_tokens=add_special)
        return ids

    def render_chat(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        tokenizer = self._llm.tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        if tools_in_messages(messages, tools) and "tool" not in template:
            messages, tools = builtin_messages(messages, tools), None
        rendered: str = tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            **({"tools": tools} if tools else {}),
            tokenize=False,
            add_generation_prompt=True,
        )
        return rendered

    def submit(self, prompt: list[int], params: SamplingParams) -> _TrtStream:
        if self._stopping:
            raise EngineStoppingError("the engine is shutting down")
        if len(self._waiting) >= self._max_queue:
            raise QueueFullError(len(self._waiting))
        return _TrtStream(self, prompt, params)

    def set_max_batch_size(self, n: int) -> None:
        if not 1 <= n <= self._capacity:
            raise ValueError(f"maxBatchSize must be within 1..{self._capacity}, got {n}")
        self._max_batch = n
        self._admit()

    def state(self) -> EngineState:
        return EngineState(
            max_batch_size=self._max_batch,
            capacity=self._capacity,
            active=self._active,
            queued=len(self._waiting),
            last_step_sequences=self._active,
            steps=0,
        )

    def _generate(self, prompt: list[int], params: SamplingParams) -> Any:
        return self._llm.generate_async(
            prompt, sampling_params=self._sampling(params), streaming=True
        )

    def _sampling(self, params: SamplingParams) -> Any:
        """Our parameters as `tensorrt_llm.SamplingParams` (None: the runtime's default)."""
        # Stop strings are not passed on: TensorRT-LLM matches them as token ids after the
        # tokens are streamed, so a stop string spanning tokens would already be partly out
        # (and one tokenized differently in context never matches). _TrtStream matches text.
        if params.greedy:
            # TensorRT-LLM's greedy test (SamplingParams.params_imply_greedy_decoding) is all
            # of temperature/top_p/top_k unset, or top_k == 1, top_p == 0 or temperature == 0;
            # top_k=1 alone means greedy in every release (older ones also read top_p=1.0 as
            # sampling, so it is left unset here).
            return self._sampling_cls(max_tokens=params.max_tokens, top_k=1)
        # Unset, the C++ runtime seeds every request with 0: identical prompts would all draw
        # the same "random" text. OpenAI semantics are a fresh draw unless a seed is given.
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return self._sampling_cls(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,  # explicit 1.0: all unset would mean greedy
            seed=seed,
        )

    def _slot(self) -> _Slot:
        return _Slot(self)

    def _admit(self) -> None:
        while self._waiting and self._active < self._max_batch:
            future = self._waiting.popleft()
            if not future.done():
                self._active += 1
                future.set_result(None)


class _Slot:
    """Admission gate honouring the admin batch limit (TensorRT-LLM's own is fixed at build)."""

    def __init__(self, engine: TrtLlmEngine) -> None:
        self._engine = engine

    async def __aenter__(self) -> None:
        engine = self._engine
        if engine._active < engine._max_batch and not engine._waiting:
            engine._active += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        engine._waiting.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._engine._active -= 1  # admitted just as the client left: give it back
                engine._admit()
            elif future in engine._waiting:
                engine._waiting.remove(future)
            raise

    async def __aexit__(self, *_exc: object) -> None:
        self._engine._active -= 1
        self._engine._admit()
