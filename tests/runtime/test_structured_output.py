"""Strict structured output: the json_schema grammar admits only JSON that parses and validates.

Through the `openai` client's `parse` and LangChain's `with_structured_output` over a pydantic
model with nested objects, arrays, enums and optional fields, on the real engine; and the
grammar itself, token by token on the real vocabulary, for required properties,
`additionalProperties: false`, enums and JSON's number syntax. A 270M base model counts
upwards forever inside an unbounded array (or string), so the model bounds its lists and
strings (`maxItems`, `maxLength`, which the grammar enforces) and the assertions are about
validity, not content.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from ember_runtime.engines.base import InvalidRequestError
from ember_runtime.engines.grammar import for_response_format
from ember_runtime.engines.llamacpp import LlamaCppEngine
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, SecretStr

from tests.runtime.conftest import LiveServer
from tests.runtime.test_json_grammar import accepts

MODEL = "gemma-3-270m"
ASK: list[Any] = [{"role": "user", "content": "Oslo weather readings as JSON."}]


class Unit(enum.StrEnum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


Short = Annotated[str, Field(max_length=24)]


class Place(BaseModel):
    city: Short
    country: Short | None


class Station(BaseModel):
    name: Short
    height_m: int


class Reading(BaseModel):
    place: Place
    unit: Unit
    temperatures: Annotated[list[float], Field(max_length=3)]
    stations: Annotated[list[Station], Field(max_length=2)]
    note: Short | None = None


SCHEMA = to_strict_json_schema(Reading)


class Brief(BaseModel):
    """Smaller, for LangChain's function calling: the tool's description goes in the prompt,
    and the test server's context is 512 tokens."""

    city: Short
    unit: Unit
    temperatures: Annotated[list[float], Field(max_length=2)]
    note: Short | None = None


def test_the_strict_schema_is_what_the_grammar_is_given() -> None:
    """What `parse` sends: every property required, no others, optional ones nullable."""
    assert SCHEMA["additionalProperties"] is False
    assert set(SCHEMA["required"]) == set(Reading.model_fields)
    assert SCHEMA["$defs"]["Place"]["additionalProperties"] is False
    assert SCHEMA["properties"]["temperatures"]["maxItems"] == 3


def test_strict_grammar_enforces_required_closed_objects_enums_and_json_numbers(
    server: LiveServer,
) -> None:
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    grammar = for_response_format("json_schema", SCHEMA, strict=True)
    assert grammar is not None
    good: dict[str, Any] = {
        "place": {"city": "Oslo", "country": None},
        "unit": "celsius",
        "temperatures": [-0.5, 1e3, 0, 12.25, -3e-2][:3],
        "stations": [{"name": "Blindern", "height_m": 94}],
        "note": None,
    }

    def text(**change: Any) -> str:
        return json.dumps({**good, **change})

    for ok in (text(), text(note="wet\\n"), text(temperatures=[]), text(stations=[])):
        jsonschema.validate(json.loads(ok), SCHEMA)
        assert accepts(engine, grammar, ok), ok
    bad = [
        text(unit="kelvin"),  # not in the enum
        text(place={"city": "Oslo"}),  # a required (nullable) property missing
        text(place={"city": "Oslo", "country": None, "zip": 1}),  # additionalProperties
        text(note="x" * 25),  # maxLength
        text(temperatures=[1, 2, 3, 4]),  # maxItems
        text(stations=[{"name": "B", "height_m": 9.5}]),  # an integer property
        json.dumps({k: v for k, v in good.items() if k != "note"}),  # required at the root
    ]
    bad += [text().replace("-0.5", number) for number in ("01", "1.", ".5", "+1", "NaN", "0x1")]
    bad += [text().replace('"Oslo"', '"Os\tlo"')]  # a raw control character in a string
    for wrong in bad:
        assert not accepts(engine, grammar, wrong), wrong


def test_strict_schemas_refuse_what_the_grammar_cannot_enforce() -> None:
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    with pytest.raises(InvalidRequestError, match="minimum"):
        for_response_format("json_schema", bounded, strict=True)
    # A property *named* like a keyword is data, not a keyword; non-strict is best effort.
    named = {"type": "object", "properties": {"minimum": {"type": "integer"}}}
    assert for_response_format("json_schema", named, strict=True)
    assert for_response_format("json_schema", bounded, strict=False)


async def test_openai_parse_returns_the_pydantic_model(server: LiveServer) -> None:
    async with AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180
    ) as client:
        reply = await client.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=Reading, temperature=0, max_tokens=300
        )
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=8,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "strict": True,
                        "schema": {"type": "integer", "exclusiveMaximum": 9},
                    },
                },
            )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Reading)
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert info.value.param == "response_format"
    assert "exclusiveMaximum" in str(info.value.body)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(
    server: LiveServer, method: Literal["json_schema", "function_calling"]
) -> None:
    llm = ChatOpenAI(
        base_url=server.url + "/v1",
        api_key=SecretStr("unused"),
        model=MODEL,
        temperature=0,
        max_completion_tokens=200,
    )
    out = llm.with_structured_output(Brief, method=method, strict=True).invoke(ASK[0]["content"])
    assert isinstance(out, Brief)
    jsonschema.validate(out.model_dump(mode="json"), to_strict_json_schema(Brief))
