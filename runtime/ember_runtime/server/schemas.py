"""Request and response models of the OpenAI-compatible API.

Requests are strict (a string where a number belongs is a 400, not a silent coercion), and no
parameter is silently ignored: every OpenAI parameter is either implemented, or accepted only
at a value that changes nothing (`UNSUPPORTED`: e.g. `functions` absent or empty), or answered with
a 400 that names it; a field OpenAI does not define is a 400 too. `user`, `metadata`, `store`
and `service_tier` pass: they label or route a request at OpenAI and change no output here.
Streaming chunks are not modelled here: they are built from pre-serialised templates in
`generation.py`, since they are made once per token.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember_runtime.thermal.governor import DEFAULT_OVERRIDE_SECONDS, MAX_OVERRIDE_SECONDS

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is a sequence in the queue)
MAX_CHOICES = 64  # prompts x n: each choice is a sequence of its own in the engine's queue
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bounds
MAX_TOP_LOGPROBS = 20

# Parameters not implemented here (OpenAI's and llama-server's), with the values at which they
# change nothing. llama-server's knobs that only tune a sampler left off here (mirostat_tau,
# dry_base, xtc_threshold, ...) pass at any value: they change nothing while it is off.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "mirostat": (None, 0),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0),
    "top_n_sigma": (None, -1, -1.0, 0, 0.0),
    "dynatemp_range": (None, 0, 0.0),
    "samplers": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    # llama-server's sampling fields, with its meaning (docs/sampling.md); defaults change nothing.
    top_k: int = 0  # <= 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    min_keep: Annotated[int, Field(ge=0)] = 0
    repeat_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    repeat_last_n: Annotated[int, Field(ge=-1)] = 64  # -1: the whole context
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # OpenAI: {"token id": bias}; llama-server also: [[token id or text, bias or false], ...]
    logit_bias: dict[str, float] | list[list[Any]] | None = None
    ignore_eos: bool = False
    # Ember: false turns speculative decoding off for this request (None: the engine's
    # `engine.speculation`); the tokens' distribution is the same either way.
    speculative: bool | None = None
    # Pass through: they change nothing here (see the module docstring).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI's default
    # Not implemented: refused by `unsupported()` unless harmless.
    mirostat: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    top_n_sigma: Any = None
    dynatemp_range: Any = None
    samplers: Any = None
    # Tune only a sampler that is refused above unless off: change nothing here.
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    xtc_threshold: Any = None
    dynatemp_exponent: Any = None

    def unsupported(self) -> str | None:
        """The first parameter set to a value this server does not implement, if any."""
        for name, harmless in UNSUPPORTED.items():
            if name in type(self).model_fields and getattr(self, name) not in harmless:
                return name
        return None

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
    # OpenAI's four forms: a string, token ids, a list of strings, a list of token-id lists.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Any = None
    suffix: Any = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's calls
    name: str | None = None  # accepted; chat templates here have no place for it
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    refusal: str | None = None  # sent back by clients that replay a reply; changes nothing

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(_Request):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: no arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # also refuse keywords the grammar cannot enforce (grammar.py)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None


class BatchSizeRequest(BaseModel):
    """A manual override of the thermal governor's batch limit, until it expires."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_batch_size: Annotated[int, Field(ge=1, alias="maxBatchSize")]
    expires_in_seconds: Annotated[
        float, Field(gt=0, le=MAX_OVERRIDE_SECONDS, alias="expiresInSeconds", strict=False)
    ] = DEFAULT_OVERRIDE_SECONDS


# --- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls
    tool_calls: Annotated[list[ToolCallOut] | None, Field(exclude_if=lambda v: v is None)] = None


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
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
