"""Render a model's own Jinja chat template (from GGUF metadata) the way transformers does.

llama.cpp's `llama_chat_apply_template` only recognises built-in template families by pattern;
rendering the real template with a sandboxed Jinja environment follows the model exactly.
Tools and tool messages reach the template as transformers and llama.cpp's `--jinja` pass
them: `tools` is OpenAI's list of tool objects, an assistant message carries `tool_calls`
with `function.arguments` as an object (templates write it with `tojson`), and a tool result
is a `tool` message with its `tool_call_id`.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember_runtime.engines.base import ChatMessage, ToolCall

_env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON, as
    # transformers' override gives them.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_env.filters["tojson"] = _tojson
_compile = functools.lru_cache(maxsize=8)(_env.from_string)


def _raise(message: str) -> NoReturn:
    raise ValueError(message)


def _call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments  # templates that print it as text still get it
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it (transformers' and llama.cpp's shape)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def render_template(
    template: str,
    messages: list[ChatMessage],
    *,
    bos_token: str,
    eos_token: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` and open the assistant's turn; template errors become ValueError."""
    try:
        return _compile(template).render(
            messages=[template_message(m) for m in messages],
            tools=tools or None,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=True,
            raise_exception=_raise,
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from exc
