"""JSON schemas as GBNF grammars for llama.cpp's grammar sampler (`response_format`, tools).

The converters are llama-cpp-python's (`llama_cpp.llama_grammar`, a port of llama.cpp's own
json-schema-to-grammar): `json_object` is its JSON grammar (an object at the root, whitespace
runs bounded so a model cannot pad forever), `json_schema` is the schema converted rule by rule.
An object admits the properties the schema lists, `required` ones always, others only where
`additionalProperties` allows them (absent counts as false, as OpenAI's strict mode wants).

One correction: the converter's string character rule (`char ::= [^"\\] | …`) admits raw
control characters, which JSON forbids inside strings (RFC 8259: U+0000-U+001F must be
escaped), so a model could write a bare newline in a value and the reply would not parse
(`openai`'s `parse` failed so). Its rule is replaced by llama.cpp's own, which excludes them.

The converter ignores the keywords it cannot express (numeric bounds, `uniqueItems`, ...).
A `strict` schema promises a reply that validates, so one using them is refused (400) rather
than served with a promise the grammar cannot keep; a non-strict one is served best-effort.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ember_runtime.engines.base import InvalidRequestError

# The converter's rule for one character of a JSON string, and the same without raw controls.
_LOOSE_CHAR = 'char ::= [^"\\\\] | '
_JSON_CHAR = 'char ::= [^"\\\\\\x00-\\x1F] | '

# JSON Schema keywords the converter silently drops: a reply could break them.
UNENFORCED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "uniqueItems",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# Keys whose value maps names to schemas, and keys whose value is data, not a schema.
_NAMED = frozenset({"properties", "$defs", "definitions"})
_DATA = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})


def for_response_format(
    kind: str, schema: dict[str, Any] | None, *, strict: bool = False
) -> str | None:
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
    converter = new_converter()
    visit_schema(converter, schema, "", strict=strict, param="response_format")
    return strict_strings(converter.format_grammar())


def new_converter() -> Any:
    """llama-cpp-python's schema converter, as `json_schema_to_gbnf` sets it up."""
    from llama_cpp import llama_grammar  # noqa: PLC0415 - loads libllama; llamacpp engine only

    return llama_grammar.SchemaConverter(  # type: ignore[no-untyped-call]
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )


def visit_schema(converter: Any, schema: Any, name: str, *, strict: bool, param: str) -> str:
    """Add `schema`'s rules to `converter` (its `$ref`s resolved within it); the name of its
    rule. An unusable schema is a 400 naming `param`."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    if strict:
        check_enforceable(schema, param)
    try:
        resolved = converter.resolve_refs(copy.deepcopy(schema), name or "schema")
        rule: str = converter.visit(resolved, name)
    except Exception as exc:  # the converter raises bare AssertionErrors/KeyErrors
        raise InvalidRequestError(f"{param} cannot be enforced: {exc}", param=param) from exc
    return rule


def check_enforceable(schema: Any, param: str, path: str = "#") -> None:
    """Refuse a keyword the grammar would ignore (see the module docstring)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_enforceable(item, param, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNENFORCED:
            raise InvalidRequestError(
                f"{param}: {key!r} (at {path}) cannot be enforced by the grammar, so a strict "
                "schema may not use it",
                param=param,
            )
        if key in _NAMED and isinstance(value, dict):
            for sub, item in value.items():
                check_enforceable(item, param, f"{path}/{key}/{json.dumps(sub)}")
        elif key not in _DATA:
            check_enforceable(value, param, f"{path}/{key}")


def strict_strings(grammar: str) -> str:
    """The grammar with JSON's string characters: no raw control character (see above)."""
    if "\nchar ::=" not in "\n" + grammar:
        return grammar  # the schema has no free-form string
    if _LOOSE_CHAR not in grammar:  # a new converter: fail loudly rather than emit bad JSON
        raise RuntimeError("llama_grammar's char rule changed; review engines/grammar.py")
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)
