"""Fake `tensorrt_llm` for the adapter's tests (see ../README.md): public names, real semantics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

instances: list[LLM] = []  # every LLM constructed, so a test can look at what the adapter did


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """The fields of `tensorrt_llm.SamplingParams` the adapter may set (unknown ones: TypeError)."""

    end_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None

    @staticmethod
    def params_imply_greedy_decoding(
        *, temperature: float | None, top_p: float | None, top_k: int | None
    ) -> bool:
        # The real rule, which both the PyTorch sampler and the LLM API's checks go by.
        return (
            (temperature is None and top_p is None and top_k is None)
            or top_k == 1
            or top_p == 0.0
            or temperature == 0
        )

    @property
    def _greedy_decoding(self) -> bool:
        return self.params_imply_greedy_decoding(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )


class Tokenizer:
    """Bytes shifted by 3 (0 pad, 1 bos, 2 eos), with HF-style keyword arguments."""

    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(i - 3 for i in token_ids if i >= 3).decode("utf-8", "replace")

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
    ) -> str | list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in conversation)
        text += "<|assistant|>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "timeout", "cancelled"] | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class RequestOutput:
    """One request; iterating it (streaming) waits for the next step, like the real one."""

    def __init__(self, llm: LLM, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self._tokenizer = llm.tokenizer
        self._outputs = [CompletionOutput(0)]
        self._done = False
        self.abort_calls = 0

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.abort_calls += 1

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await asyncio.sleep(0)  # one decoding step of the in-flight batch
        self._step()
        return self

    def _step(self) -> None:
        out = self._outputs[0]
        out._last_text_len, out._last_token_ids_len = len(out.text), len(out.token_ids)
        if self.abort_calls:
            self._finish("cancelled")  # the executor's final response for an aborted request
            return
        # The "model" echoes the prompt (without BOS) over and over.
        body = [t for t in self.prompt_token_ids if t != self._tokenizer.bos_token_id]
        out.token_ids.append(body[len(out.token_ids) % len(body)])
        if self._hit_stop_word(out):
            self._finish("stop")
        elif len(out.token_ids) >= self.sampling_params.max_tokens:
            self._finish("length")
        out.text = self._tokenizer.decode(out.token_ids)

    def _hit_stop_word(self, out: CompletionOutput) -> bool:
        # Token-level stop words, trimmed from the output as the real result handler does.
        stops = self.sampling_params.stop
        for word in [stops] if isinstance(stops, str) else stops or []:
            ids = self._tokenizer.encode(word, add_special_tokens=False)
            if out.token_ids[-len(ids) :] == ids:
                if not self.sampling_params.include_stop_str_in_output:
                    del out.token_ids[-len(ids) :]
                return True
        return False

    def _finish(self, reason: Literal["stop", "length", "timeout", "cancelled"]) -> None:
        self._outputs[0].finish_reason = reason
        self._done = True


class LLM:
    """`tensorrt_llm.LLM` (the PyTorch backend in 1.x: checkpoints, not prebuilt engines)."""

    backend = "pytorch"
    max_seq_len = 256

    def __init__(self, model: str | Path) -> None:
        self.model = Path(model)
        self.tokenizer = Tokenizer()
        self.requests: list[RequestOutput] = []
        self.shut_down = False
        instances.append(self)

    def generate_async(
        self,
        inputs: str | list[int],
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
    ) -> RequestOutput:
        if self.shut_down:
            raise RuntimeError("LLM is shutting down")
        params = sampling_params or SamplingParams()
        ids = self.tokenizer.encode(inputs) if isinstance(inputs, str) else list(inputs)
        if len(ids) + params.max_tokens > self.max_seq_len:  # the real _check_arguments
            raise ValueError(
                f"The sum of prompt length ({len(ids)}) and max_tokens ({params.max_tokens}) "
                f"should not exceed max_seq_len ({self.max_seq_len})"
            )
        result = RequestOutput(self, ids, params)
        self.requests.append(result)
        return result

    def shutdown(self) -> None:
        self.shut_down = True
