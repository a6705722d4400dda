"""`response_format` as a GBNF grammar for llama.cpp's grammar sampler.

The converters are llama-cpp-python's (`llama_cpp.llama_grammar`, a port of llama.cpp's own
json-schema-to-grammar): `json_object` is its JSON grammar (an object at the root, whitespace
runs bounded so a model cannot pad forever), `json_schema` is the schema converted rule by rule.

One correction: the converter's string character rule (`char ::= [^"\\] | …`) admits raw
control characters, which JSON forbids inside strings (RFC 8259: U+0000-U+001F must be
escaped), so a model could write a bare newline in a value and the reply would not parse
(`openai`'s `parse` failed so). Its rule is replaced by llama.cpp's own, which excludes them.
"""

from __future__ import annotations

import json
from typing import Any

from ember_runtime.engines.base import InvalidRequestError

# The converter's rule for one character of a JSON string, and the same without raw controls.
_LOOSE_CHAR = 'char ::= [^"\\\\] | '
_JSON_CHAR = 'char ::= [^"\\\\\\x00-\\x1F] | '


def for_response_format(kind: str, schema: dict[str, Any] | None) -> str | None:
    """The grammar for an OpenAI `response_format` type; None for plain text."""
    if kind == "text":
        return None
    from llama_cpp import llama_grammar  # noqa: PLC0415 - loads libllama; llamacpp engine only

    if kind == "json_object":
        return str(llama_grammar.JSON_GBNF)
    if not schema:
        raise InvalidRequestError(
            "response_format json_schema needs json_schema.schema", param="response_format"
        )
    try:
        grammar = str(llama_grammar.json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # the converter raises bare Exceptions/KeyErrors on odd schemas
        raise InvalidRequestError(
            f"response_format json_schema cannot be enforced: {exc}", param="response_format"
        ) from exc
    return strict_strings(grammar)


def strict_strings(grammar: str) -> str:
    """The grammar with JSON's string characters: no raw control character (see above)."""
    if "\nchar ::=" not in "\n" + grammar:
        return grammar  # the schema has no free-form string
    if _LOOSE_CHAR not in grammar:  # a new converter: fail loudly rather than emit bad JSON
        raise RuntimeError("llama_grammar's char rule changed; review engines/grammar.py")
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)
