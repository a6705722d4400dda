"""Streaming a reply with tools as OpenAI's chunks: content deltas, then tool-call deltas.

Text streams as content until `<tool_call>` appears (a possible start of it is held back).
A call in the built-in format streams as it is written: once its header
`{"name": "...", "arguments": ` is complete, one delta with the index, id, type, name and
empty arguments, then each new piece of the arguments object as an arguments delta with the
index, which is how OpenAI streams and how the `openai` helpers and LangChain assemble calls.
A block in another shape is sent whole when it closes; a reply that may be one bare JSON call
(Llama 3.x) is held until the end, since only the whole reply can tell.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ember_runtime.engines import tools as fmt
from ember_runtime.engines.base import Delta
from ember_runtime.server.generation import SSEFramer
from ember_runtime.server.schemas import ToolCallOut
from ember_runtime.server.toolcalls import ToolPlan, call_out

_HEAD = re.compile(
    re.escape(fmt.OPEN)
    + r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)'
)


@dataclass(slots=True)
class _OpenCall:
    """A call block being written: where its arguments start, how much of them is sent."""

    args_at: int | None = None  # None until the header is complete
    sent: int = 0


class ToolSSEFramer(SSEFramer):
    def __init__(self, tools: ToolPlan, **kwargs: Any) -> None:
        super().__init__(chat=True, **kwargs)
        self._tools = tools
        self._names = {f.name for f in tools.offered}
        self._pending = ""  # text not yet sent: a call being written, or maybe one starting
        self._open: _OpenCall | None = None
        self._calls = 0

    def delta(self, delta: Delta) -> str | None:
        self._pending += delta.text
        out: list[str] = []
        while self._pending:
            if self._open is None and not self._enter_call(out):
                break
            if not self._advance_call(out):
                break
        return "".join(out) or None

    def _enter_call(self, out: list[str]) -> bool:
        """Send the text before a call; False when no call starts in what is pending."""
        start = self._pending.find(fmt.OPEN)
        cut = start if start >= 0 else len(self._pending) - self._held(self._pending)
        out.append(self._content(self._pending[:cut]))
        self._pending = self._pending[cut:]
        if start < 0:
            return False
        self._open = _OpenCall()
        return True

    def _held(self, text: str) -> int:
        """How much of the text's end to hold back: a possible start of `<tool_call>`, or all
        of a reply that may be one bare JSON call."""
        if (self._calls == 0 and text.lstrip().startswith("{")) or not text.strip():
            return len(text)
        for n in range(min(len(fmt.OPEN) - 1, len(text)), 0, -1):
            if fmt.OPEN.startswith(text[-n:]):
                return n
        return 0

    def _advance_call(self, out: list[str]) -> bool:
        """Stream what is new in the open call; True when its block closed."""
        call = self._open
        assert call is not None
        if call.args_at is None:
            head = _HEAD.match(self._pending)
            if head is not None and head.group(1) in self._names:
                call.args_at = head.end()
                out.append(self._head_chunk(call_out(head.group(1), "")))
        end = None
        if call.args_at is not None:
            args = self._pending[call.args_at :]
            value_end = _value_end(args)
            upto = len(args) if value_end is None else value_end
            if upto > call.sent:
                out.append(self._args_chunk(self._calls, args[call.sent : upto]))
                call.sent = upto
            if value_end is not None:
                end = self._pending.find(fmt.CLOSE, call.args_at + value_end)
        else:
            end = self._pending.find(fmt.CLOSE)
        if end is None or end < 0:
            return False
        end += len(fmt.CLOSE)
        if call.args_at is None:  # not the built-in header: the block whole, if a call
            content, calls = self._tools.parse(self._pending[:end])
            out += [self._content(content or ""), *map(self._whole_call, calls)]
        else:
            self._calls += 1
        self._pending, self._open = self._pending[end:], None
        return True

    def _content(self, text: str) -> str:
        return self.text(text) if text else ""

    def _head_chunk(self, call: ToolCallOut) -> str:
        return self._tool_chunk(
            {
                "index": self._calls,
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": ""},
            }
        )

    def _args_chunk(self, index: int, arguments: str) -> str:
        return self._tool_chunk({"index": index, "function": {"arguments": arguments}})

    def _whole_call(self, call: ToolCallOut) -> str:
        out = self._head_chunk(call) + self._args_chunk(self._calls, call.function.arguments)
        self._calls += 1
        return out

    def _tool_chunk(self, call: dict[str, Any]) -> str:
        delta = json.dumps({"tool_calls": [call]}, ensure_ascii=False)
        return f'{self._head}"delta":{delta},"logprobs":null,"finish_reason":null}}]}}\n\n'

    def finish(self, reason: str) -> str:
        """What is left (a whole-reply call, or text), then the finish."""
        rest = ""
        streaming_call = self._open is not None and self._open.args_at is not None
        if streaming_call:  # a call cut short (or left unclosed): its pieces are already out
            self._calls += 1
        else:
            if reason == "length":
                self._pending = fmt.drop_cut_call(self._pending)
            content, calls = self._tools.parse(self._pending) if not self._calls else (None, [])
            if not calls:
                content = self._pending.strip() if self._calls else self._pending
            rest = self._content(content or "") + "".join(map(self._whole_call, calls))
        self._pending, self._open = "", None
        if self._calls and reason == "stop":
            reason = "tool_calls"
        return rest + super().finish(reason)


def _value_end(text: str) -> int | None:
    """Where the JSON object at the start of `text` (which _HEAD ensures) ends; None if it
    does not end yet."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
