"""Tool calls in text: Ember's built-in format, its grammar, and the parser (docs/tool-calls.md).

A call is written the way Hermes-style models (Qwen 2.5/3, Hermes 2/3) write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

For a model without a chat template of its own that knows tools, `builtin_messages` rewrites
the conversation into plain turns in that format (the tool list in the system turn, calls in
the assistant's turns, results as `<tool_response>` user turns), which the model's own turn
format then wraps. The grammar admits exactly that format, each call's arguments constrained
by its function's JSON schema, so a call always parses and validates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ember_runtime.engines.base import ChatMessage
from ember_runtime.engines.grammar import new_converter, strict_strings, visit_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # OpenAI's default


@dataclass(frozen=True, slots=True)
class Function:
    """One function the client offers (OpenAI's `tools[i].function`)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool = False

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates receive `tools`."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def format_call(name: str, arguments: str) -> str:
    """One call in the built-in format; `arguments` is JSON text."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. "
        f"The functions are:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object inside <tool_call></tool_call> tags, "
        f'one block per call:\n{OPEN}\n{{"name": <function-name>, "arguments": '
        f"<arguments-object>}}\n{CLOSE}"
    )


def builtin_messages(
    messages: list[ChatMessage], tools: list[dict[str, Any]] | None
) -> list[ChatMessage]:
    """The conversation as plain system/user/assistant turns in the built-in format; `tools`
    are OpenAI's tool objects."""
    out: list[ChatMessage] = []
    if tools:
        prompt = system_prompt(tools)
        if messages and messages[0].role == "system":
            prompt = f"{messages[0].content}\n\n{prompt}"
            messages = messages[1:]
        out.append(ChatMessage("system", prompt))
    for m in messages:
        if m.role == "tool":
            result = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.startswith("<tool_response>"):
                out[-1] = ChatMessage("user", f"{out[-1].content}\n{result}")  # one turn
            else:
                out.append(ChatMessage("user", result))
        elif m.tool_calls:
            calls = [format_call(c.name, c.arguments) for c in m.tool_calls]
            out.append(ChatMessage(m.role, "\n".join(([m.content] if m.content else []) + calls)))
        else:
            out.append(m)
    return out


def parse(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The reply's content (None when only calls) and its calls as (name, arguments JSON).

    Recognised: `<tool_call>{"name", "arguments"}</tool_call>` blocks (the built-in format,
    Hermes, Qwen), and a whole reply that is one such JSON object (Llama 3.x writes calls so,
    with `parameters` for `arguments`). A block that does not name an offered function with an
    object of arguments is left in the content, as is an unclosed one (a reply cut short).
    """
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is not None:
            kept.append(text[end : match.start()])
            calls.append(call)
            end = match.end()
    if not calls:
        whole = _call(text.strip(), names) if text.lstrip().startswith("{") else None
        return (None, [whole]) if whole is not None else (text, [])
    content = "".join([*kept, text[end:]]).strip()
    return content or None, calls


def drop_cut_call(text: str) -> str:
    """The text without a last call block left open (a reply cut short by max_tokens): it is
    markup of a call that did not happen, not content."""
    start = text.rfind(OPEN)
    return text[:start] if start >= 0 and CLOSE not in text[start:] else text


def _call(body: str, names: set[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return str(obj["name"]), json.dumps(arguments, ensure_ascii=False)


def grammar(functions: list[Function], *, parallel: bool, free_text: bool) -> str:
    """GBNF for calls to `functions` in the built-in format: only calls (one, or several when
    `parallel`), or with `free_text` any text that, once it writes `<tool_call>`, goes on as a
    valid call (tool_choice auto). Arguments follow each function's schema."""
    converter = new_converter()
    alternatives = []
    for i, f in enumerate(functions):
        param = f"tools: function {f.name}'s parameters"  # the message; the 400 names `tools`
        args = visit_schema(converter, f.parameters, f"fn{i}-args", strict=f.strict, param=param)
        head = converter._format_literal(f'{{"name": {json.dumps(f.name)}, "arguments": ')
        alternatives.append(converter._add_rule(f"fn{i}-call", f'{head} {args} "}}"'))
    body = converter._add_rule("call-body", " | ".join(alternatives))
    close = converter._format_literal(f"\n{CLOSE}")
    call = converter._add_rule("tool-call", f'"<tool_call>\\n" {body} {close}')
    more = f' ("\\n" {call})*' if parallel else ""
    rules = [converter.format_grammar()]
    if free_text:
        rules += _text_until_open(f'"\\n" {body} {close}{more}')
    else:
        rules.append(f"root ::= {call}{more}")
    return strict_strings("\n".join(rules))


def _text_until_open(rest: str) -> list[str]:
    """Rules for any text, up to `<tool_call>` which must go on as `rest`: a matcher for the
    marker (state i = its first i characters just written), so text is free until then."""
    rules = ["root ::= text-0"]
    for i, char in enumerate(OPEN):
        after = rest if i == len(OPEN) - 1 else f"text-{i + 1}"
        others = "[^<]" if i == 0 else f"[^{char}<]"
        back = "" if i == 0 else ' | "<" text-1'
        rules.append(f'text-{i} ::= | "{char}" {after}{back} | {others} text-0')
    return rules


def tools_in_messages(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> bool:
    """Whether rendering involves tools at all: offered ones, calls or results."""
    return bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
