"""Tool calls on /v1/chat/completions: the request's tools checked, messages converted, and
the model's text turned into OpenAI's `tool_calls`, whole or streamed (docs/tool-calls.md).

The text format, its grammar and its parser are in `engines/tools.py`; this module is the
OpenAI side of it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ember_runtime.engines import tools as fmt
from ember_runtime.engines.base import ChatMessage, InvalidRequestError, ToolCall
from ember_runtime.server.errors import APIError
from ember_runtime.server.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    ChatMessageOut,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How this request may call tools: the functions, and whether it must call (`required`,
    or only `named`) or may answer in text (`auto`)."""

    functions: list[fmt.Function]
    mode: str  # "auto" or "required"
    parallel: bool
    named: str | None = None

    @property
    def offered(self) -> list[fmt.Function]:
        return [f for f in self.functions if self.named in (None, f.name)]

    @property
    def free_until(self) -> str:
        """Where the grammar's free text ends (SamplingParams.grammar_free_until)."""
        return fmt.OPEN if self.mode == "auto" else ""

    def tool_objects(self) -> list[dict[str, Any]]:
        return [f.as_tool() for f in self.offered]

    def grammar(self) -> str:
        try:
            return fmt.grammar(self.offered, parallel=self.parallel, free_text=self.mode == "auto")
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="tools", code="invalid_schema") from exc

    def parse(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        content, calls = fmt.parse(text, {f.name for f in self.offered})
        return content, [call_out(name, arguments) for name, arguments in calls]


def plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; None when it calls no tools (none offered, or `none`).
    Inconsistent tools or tool_choice are a 400 naming the field."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = [
        fmt.Function(
            name=t.function.name,
            parameters=fmt.NO_PARAMETERS
            if t.function.parameters is None
            else t.function.parameters,
            description=t.function.description,
            strict=bool(t.function.strict),
        )
        for t in body.tools
    ]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", param="tools")
    if choice == "none":
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in names:
        raise APIError(
            400, f"tool_choice names {named!r}, which is not in tools", param="tool_choice"
        )
    mode = "auto" if choice in (None, "auto") else "required"
    # A named function is one call (as OpenAI answers it); otherwise OpenAI's default, parallel.
    parallel = named is None and body.parallel_tool_calls is not False
    return ToolPlan(functions, mode, parallel=parallel, named=named)


def chat_messages(body: ChatCompletionRequest) -> list[ChatMessage]:
    """The request's messages for the engine; a 400 for a tool turn without its call id or a
    message without content that has no calls either."""
    return [_message(i, m) for i, m in enumerate(body.messages)]


def _message(i: int, m: ChatMessageIn) -> ChatMessage:
    if m.role == "tool" and not m.tool_call_id:
        raise APIError(400, "a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
    if m.tool_calls and m.role != "assistant":
        raise APIError(400, "only assistant messages carry tool_calls", param=f"messages.{i}")
    if m.content is None and not m.tool_calls:
        raise APIError(400, "content is required", param=f"messages.{i}.content")
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    # "developer" is OpenAI's newer name for the system role; templates know "system".
    role = "system" if m.role == "developer" else m.role
    return ChatMessage(role, m.text(), tool_calls=calls, tool_call_id=m.tool_call_id)


def call_out(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCallOut(name=name, arguments=arguments)
    )


def reply(
    text: str, finish_reason: str | None, tools: ToolPlan
) -> tuple[ChatMessageOut, str | None]:
    """The assistant message and finish reason for a finished reply's text (a call cut short
    by max_tokens is dropped: only its start exists)."""
    if finish_reason == "length":
        text = fmt.drop_cut_call(text)
    content, calls = tools.parse(text)
    if not calls:
        return ChatMessageOut(content=text), finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return ChatMessageOut(content=content, tool_calls=calls), reason
