"""The engine interface the HTTP server talks to, whatever runs the model underneath.

An engine owns scheduling: requests are submitted as token ids with sampling parameters and come
back as an async stream of text deltas. The server never touches the model directly, so the
llama.cpp engine (continuous batching on CPU) and the TensorRT-LLM adapter are interchangeable.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np


class EngineError(Exception):
    """An engine failure that is not the client's fault (HTTP 500)."""


class EngineUnavailableError(EngineError):
    """The engine cannot start here (missing library, GPU or model file)."""


class QueueFullError(EngineError):
    """The admission queue is full; the client should retry later (HTTP 429)."""

    def __init__(self, depth: int, retry_after_seconds: int = 1) -> None:
        super().__init__(f"the server is busy: {depth} requests are already waiting")
        self.retry_after_seconds = retry_after_seconds


class InvalidRequestError(EngineError):
    """The request asks for something this engine cannot do as given (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineStoppingError(EngineError):
    """The engine is draining for shutdown and takes no new work (HTTP 503)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"  # the client went away or the request timed out
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling, with llama-server's meaning for every field (docs/sampling.md).

    Defaults are OpenAI's: temperature 1, nothing filtered. The engine applies them in
    llama-server's order: logit bias → penalties → grammar → top_k → typical_p → top_p →
    min_p → temperature.
    """

    max_tokens: int
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's plus the top k
    grammar: str | None = None  # GBNF (root rule "root") that every generated token must fit
    # The grammar admits any text until this marker (tool_choice auto): until it appears, only
    # tokens that could start it need the grammar's check (a speed-up; same tokens allowed).
    grammar_free_until: str = ""
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0
    typical_p: float = 1.0
    min_keep: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens of the window (prompt included); resolved, never -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit; -inf bans)
    ignore_eos: bool = False
    # Not sampling, but per request like it: the served LoRA adapter (engine.adapters' name)
    # the tokens are generated with; None is the base model.
    adapter: str | None = None
    # Draft from the request's own text where the engine speculates (engines/speculative.py);
    # False keeps this request to one token per step. The tokens' distribution is the same.
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
        )

    @property
    def penalty_window(self) -> int:
        return max(0, self.repeat_last_n) if self.penalized else 0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model (before any grammar constraint)
    and its most likely alternatives, as OpenAI reports them."""

    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """One step's output for one request: new text, tokens consumed, and maybe the end."""

    text: str
    n_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@runtime_checkable
class GenerationStream(Protocol):
    """What `Engine.submit` returns: an async iterator of deltas that can be cancelled."""

    @property
    def prompt_tokens(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    def cancel(self) -> None:
        """Stop generating and free the sequence's slot; safe to call more than once."""


@dataclass(frozen=True, slots=True)
class EngineState:
    max_batch_size: int  # current limit on sequences decoded per step (admin-settable)
    capacity: int  # the most the engine can ever run at once (context sized for it)
    active: int  # sequences in the running batch
    queued: int  # admitted requests waiting for a slot
    last_step_sequences: int  # sequences decoded in the last step
    steps: int


@dataclass(frozen=True, slots=True)
class StepStats:
    seconds: float
    sequences: int
    prompt_tokens: int
    drafted: int = 0  # speculative draft tokens verified in the step
    accepted: int = 0  # of them, kept


StepObserver = Callable[[StepStats], None]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the assistant made; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers


@dataclass(slots=True)
class EngineInfo:
    name: str
    model_id: str
    context_length: int  # per sequence
    vocab_size: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    # Optional request features this engine implements: "logprobs", "grammar". The server
    # answers 400 for a request that needs one the engine lacks, never ignores it.
    features: frozenset[str] = frozenset()
    # What the deployment serves (its model.task): "generate" (completions, chat) or "embed"
    # (/v1/embeddings, by an engine that is also an `Embedder`).
    task: str = "generate"
    # LoRA adapters (engine.adapters), known once started: the names served as model ids of
    # their own, and each refused one's reason (a wrong digest, another base model).
    adapters: tuple[str, ...] = ()
    refused_adapters: dict[str, str] = field(default_factory=dict)
    # Names removed from engine.adapters while serving (a request naming one gets 404).
    removed_adapters: frozenset[str] = frozenset()


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None:
        """Load the model and warm up; raises EngineUnavailableError with a clear message."""

    async def stop(self) -> None:
        """Stop the scheduler and free the model. In-flight streams end with CANCELLED."""

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def render_chat(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Apply the model's own chat template, ending with the assistant's turn opened.
        `tools` are OpenAI's tool objects, for the template to describe to the model."""

    def submit(self, prompt: list[int], params: SamplingParams) -> GenerationStream:
        """Queue a request; raises QueueFullError or EngineStoppingError at once."""

    def set_max_batch_size(self, n: int) -> None:
        """Takes effect at the next scheduling step; raises ValueError if out of range."""

    def state(self) -> EngineState: ...


@runtime_checkable
class Embedder(Protocol):
    """An engine of a `task: embed` deployment: one vector per input (engines/embedding)."""

    info: EngineInfo

    @property
    def dimensions(self) -> int:
        """Length of every vector."""

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def embed(self, inputs: list[list[int]]) -> Awaitable[list[np.ndarray]]:
        """Queue the inputs (token ids) as one request; raises QueueFullError or
        EngineStoppingError at once. Resolves to their L2-normalised float32 vectors, in
        order; cancelling the awaitable drops the inputs not yet computed."""
