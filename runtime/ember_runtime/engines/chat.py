"""Render a model's own Jinja chat template (from GGUF metadata) the way transformers does.

llama.cpp's `llama_chat_apply_template` only recognises built-in template families by pattern;
rendering the real template with a sandboxed Jinja environment follows the model exactly.
"""

from __future__ import annotations

import functools
from typing import NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember_runtime.engines.base import ChatMessage

_env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)


_compile = functools.lru_cache(maxsize=8)(_env.from_string)


def _raise(message: str) -> NoReturn:
    raise ValueError(message)


def render_template(
    template: str, messages: list[ChatMessage], *, bos_token: str, eos_token: str
) -> str:
    """Render `messages` and open the assistant's turn; template errors become ValueError."""
    try:
        return _compile(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=True,
            raise_exception=_raise,
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from exc
