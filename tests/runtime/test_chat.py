"""Chat templates (engines/chat.py) rendered without a model; tests/runtime/test_chat_parity.py
checks the built-in template's tokens against llama-server, test_tool_calls.py the tools."""

from __future__ import annotations

import pytest
from ember_runtime.engines.base import ChatMessage
from ember_runtime.engines.chat import render_template


def test_jinja_chat_template_path() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    rendered = render_template(
        template, [ChatMessage("user", "hi")], bos_token="<s>", eos_token="</s>"
    )
    assert rendered == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(ValueError, match="no tools"):
        render_template(template, [ChatMessage("tool", "x")], bos_token="", eos_token="")
