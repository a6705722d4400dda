"""`response_format` as a GBNF grammar for llama.cpp's grammar sampler.

The converters are llama-cpp-python's (`llama_cpp.llama_grammar`, a port of llama.cpp's own
json-schema-to-grammar): `json_object` is its JSON grammar (an object at the root, whitespace
runs bounded so a model cannot pad forever), `json_schema` is the schema converted rule by rule.
"""

from __future__ import annotations

import json
from typing import Any

from ember_runtime.engines.base import InvalidRequestError


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
        return str(llama_grammar.json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # the converter raises bare Exceptions/KeyErrors on odd schemas
        raise InvalidRequestError(
            f"response_format json_schema cannot be enforced: {exc}", param="response_format"
        ) from exc
