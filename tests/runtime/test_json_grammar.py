"""The response_format grammars admit only JSON that parses: llama.cpp's grammar sampler, on
the real vocabulary, walks a text token by token and must refuse the first token that would
put a raw control character inside a string (RFC 8259), and accept the escaped form."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ember_runtime.engines.grammar import for_response_format
from ember_runtime.engines.llamacpp import LlamaCppEngine

from tests.runtime.conftest import LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
GOOD = ['{"name": "a b", "tags": ["x"]}', '{"name": "line\\nbreak\\t", "tags": []}']
BAD = ['{"name": "line\nbreak", "tags": []}', '{"name": "tab\there", "tags": []}']


def accepts(engine: LlamaCppEngine, grammar: str, text: str) -> bool:
    """Whether the grammar lets every token of `text` through (the engine's own mask)."""
    mask = engine.grammars.compile(grammar)
    try:
        for tok in engine.tokenize(text, add_special=False):
            if not np.isfinite(mask.mask(np.zeros(engine.vocab.size, np.float32))[tok]):
                return False
            mask.accept(tok)
        return True
    finally:
        mask.free()


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_strings_hold_no_raw_control_character(server: LiveServer, kind: str) -> None:
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    grammar = for_response_format(kind, SCHEMA if kind == "json_schema" else None)
    assert grammar is not None
    for text in GOOD:
        json.loads(text)  # the samples themselves are right
        assert accepts(engine, grammar, text), text
    for text in BAD:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        assert not accepts(engine, grammar, text), repr(text)
