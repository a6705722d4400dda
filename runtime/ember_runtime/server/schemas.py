"""Request and response models of the OpenAI-compatible API.

Requests are strict (a string where a number belongs is a 400, not a silent coercion) but ignore
fields we do not implement, because OpenAI clients send extras (`user`, `logprobs`, ...).
Streaming chunks are not modelled here: they are built from pre-serialised templates in
`routes.py`, since they are made once per token.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Request):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class BatchSizeRequest(BaseModel):
    """A manual override of the thermal governor's batch limit, until it expires."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_batch_size: Annotated[int, Field(ge=1, alias="maxBatchSize")]
    expires_in_seconds: Annotated[
        float, Field(gt=0, le=86_400, alias="expiresInSeconds", strict=False)
    ] = 600.0


# --- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdminState(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    max_batch_size: int = Field(serialization_alias="maxBatchSize")
    capacity: int
    queue_depth: int = Field(serialization_alias="queueDepth")
    active_sequences: int = Field(serialization_alias="activeSequences")
    last_step_sequences: int = Field(serialization_alias="lastStepSequences")
    steps: int
    temperatures: dict[str, float]
    draining: bool
    thermal_reason: str = Field(serialization_alias="thermalReason")
    override_expires_in_seconds: float | None = Field(
        default=None, serialization_alias="overrideExpiresInSeconds"
    )
