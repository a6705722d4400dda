"""A thin adapter over TensorRT-LLM's public `LLM` API (`generate_async(..., streaming=True)`).

TensorRT-LLM batches in flight on the GPU itself, so this adapter only maps our request and
stream types onto its own, and enforces the admin batch limit with an admission gate. It is
imported lazily: on a machine without TensorRT-LLM or a GPU, `start()` fails with a clear
message instead of the import failing at module load.
"""

from __future__ import annotations

import asyncio
import collections
import logging
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

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


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
            self._handle = self._engine._generate(self._prompt, self._params)
            async for output in self._handle:
                out = output.outputs[0]
                reason = _FINISH.get(str(out.finish_reason)) if output.finished else None
                yield Delta(out.text_diff, len(out.token_ids_diff), reason)
                if output.finished:
                    return

    def cancel(self) -> None:
        self.cancelled = True
        if self._handle is not None:
            self._handle.abort()


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

    def render_chat(self, messages: list[ChatMessage]) -> str:
        rendered: str = self._llm.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
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
        sampling = self._sampling_cls(
            max_tokens=params.max_tokens,
            temperature=params.temperature if not params.greedy else None,
            top_k=1 if params.greedy else None,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop) or None,
        )
        return self._llm.generate_async(prompt, sampling_params=sampling, streaming=True)

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
