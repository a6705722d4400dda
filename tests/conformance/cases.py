"""The real-client conformance matrix, defined once: each case is one everyday call made with a
real client (the `openai` package, LangChain, LiteLLM) against an OpenAI-compatible server.

`tests/conformance/test_*.py` run the cases against Ember's runtime; `bench/clients_matrix.py`
runs the same list against Ember and against `llama-server --jinja` given the same Gemma template
(bench/templates/gemma.jinja) and tabulates the outcomes.

A case is a function of (server root URL, model name). It returns on success and raises on
anything else: an assertion about the result's shape, or the client's own error. The model is a
base 270M one, so cases assert structure (fields, counts, types, that a schema's JSON parses),
never quality. A reply cut at `max_tokens` where the case needs it whole is not a pass: a
schema-less JSON reply raises `LengthLimit` (the bench lists it apart; `make test` fails on it),
a schema-bound one fails outright.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# LiteLLM fetches a model price list from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import openai
from pydantic import BaseModel, Field, SecretStr

TIMEOUT = 180.0
API_KEY = "sk-unused"  # the clients insist on one; the servers under test ask for none
QUESTION = "What is the capital of France? Answer in one word."


class LengthLimit(Exception):
    """A schema-less JSON reply (json_object, json_mode) that stopped at max_tokens (finish_reason
    "length") before its JSON closed. Not a pass: those cases show the model a one-shot example
    so that it closes its JSON well within their max_tokens; the bench names this outcome apart
    from other failures only to say where the reply went wrong."""


@dataclass(frozen=True)
class Case:
    client: str  # "openai", "langchain", "litellm"
    name: str
    run: Callable[[str, str], None]
    embed: bool = False  # needs a server that serves an embedding model
    # The request names its function with an object `tool_choice` ({"type": "function", ...}),
    # which llama-server does not read (it warns and uses its default): the bench lists these
    # failures apart.
    tool_choice_object: bool = False

    @property
    def id(self) -> str:
        return f"{self.client}: {self.name}"


def v1(base_url: str) -> str:
    return base_url.rstrip("/") + "/v1"


def _openai(base_url: str) -> openai.OpenAI:
    # No retries: a refused call must show as the refusal, not as three of them.
    return openai.OpenAI(base_url=v1(base_url), api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def _user(text: str = QUESTION) -> list[Any]:  # Any: the client types each role's dict
    return [{"role": "user", "content": text}]


def _chat(base_url: str, model: str, **kwargs: Any) -> Any:
    """One non-streamed chat completion, checked for OpenAI's shape."""
    kwargs.setdefault("messages", _user())
    kwargs.setdefault("max_tokens", 16)
    reply = _openai(base_url).chat.completions.create(model=model, **kwargs)
    assert reply.object == "chat.completion", reply
    assert reply.choices, reply
    for choice in reply.choices:
        assert choice.message.role == "assistant", choice
        assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    assert reply.usage is not None and reply.usage.completion_tokens > 0, reply.usage
    return reply


# --- structured output: bounded schemas, so a base model closes its JSON ------------------------


class Unit(enum.StrEnum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Reading(BaseModel):
    day: int
    high: int


class Forecast(BaseModel):
    """Nested object, array, enum and an optional field: the shapes `parse` users send."""

    city: str = Field(max_length=20)
    unit: Unit
    readings: list[Reading] = Field(min_length=1, max_length=2)
    note: str | None = Field(max_length=20)


class Capital(BaseModel):
    """The capital of a country."""

    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


FORECAST_PROMPT = "Give a two-day weather forecast for Paris as JSON."
CAPITAL_PROMPT = "What is the capital of France? Reply in JSON with country and capital."
# Schema-less JSON (json_object, json_mode) bounds nothing: asked cold, the base model adds keys
# until max_tokens (120 or 400 alike). One example turn first, and it answers in one line and
# stops (13 tokens, greedy).
CAPITAL_ONE_SHOT: list[Any] = [
    {
        "role": "user",
        "content": "What is the capital of Spain? Reply in JSON with country and capital.",
    },
    {"role": "assistant", "content": '{"country": "Spain", "capital": "Madrid"}'},
    {"role": "user", "content": CAPITAL_PROMPT},
]
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
WEATHER_PROMPT = "What is the weather in Paris? Use the get_weather tool."
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}


def _check_weather_args(name: str, arguments: str | dict[str, Any]) -> None:
    assert name == "get_weather", f"tool call name {name!r}, arguments {arguments!r}"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(args.get("city"), str), f"arguments {args!r}"
    assert args.get("unit") in ("celsius", "fahrenheit"), f"arguments {args!r}"


# --- openai ------------------------------------------------------------------------------------


def openai_chat(base_url: str, model: str) -> None:
    reply = _chat(base_url, model)
    assert isinstance(reply.choices[0].message.content, str), reply


def openai_stream_usage(base_url: str, model: str) -> None:
    stream = _openai(base_url).chat.completions.create(
        model=model,
        messages=_user(),
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, chunks
    usage_chunks = [c for c in chunks if c.usage is not None]
    # OpenAI: exactly one usage chunk, the last, with no choices.
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0], chunks[-3:]
    assert chunks[-1].choices == [], chunks[-1]
    usage = usage_chunks[0].usage
    assert usage is not None and 0 < usage.completion_tokens <= 8, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage


def openai_logprobs(base_url: str, model: str) -> None:
    reply = _chat(base_url, model, max_tokens=4, logprobs=True, top_logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content, reply.choices[0]
    for token in logprobs.content:
        assert token.logprob <= 0.0, token
        assert len(token.top_logprobs) == 3, token
        assert all(alt.logprob <= 0.0 for alt in token.top_logprobs), token


def openai_n2(base_url: str, model: str) -> None:
    reply = _chat(base_url, model, n=2, max_tokens=8, temperature=1.0)
    assert sorted(c.index for c in reply.choices) == [0, 1], reply.choices


def openai_parse(base_url: str, model: str) -> None:
    try:
        reply = _openai(base_url).chat.completions.parse(
            model=model,
            messages=_user(FORECAST_PROMPT),
            response_format=Forecast,
            max_tokens=200,
            temperature=0.0,
        )
    except openai.LengthFinishReasonError as exc:
        raise AssertionError(f"a bounded schema's JSON did not close: {exc}") from exc
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Forecast), reply.choices[0].message
    assert 1 <= len(parsed.readings) <= 2, parsed


def openai_json_object(base_url: str, model: str) -> None:
    reply = _chat(
        base_url,
        model,
        messages=CAPITAL_ONE_SHOT,
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0.0,
    )
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "length":
        raise LengthLimit(f"json_object reply cut at max_tokens: {content[:80]!r}")
    assert isinstance(json.loads(content), dict), content


def openai_tools(base_url: str, model: str) -> None:
    reply = _chat(
        base_url,
        model,
        messages=_user(WEATHER_PROMPT),
        tools=[WEATHER_TOOL],
        tool_choice=NAMED_TOOL,
        max_tokens=64,
    )
    message = reply.choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id, call
    _check_weather_args(call.function.name, call.function.arguments)
    # The call's own text is the call, not content a client would show (OpenAI: null).
    assert not message.content, message.content
    assert reply.choices[0].finish_reason in ("tool_calls", "stop"), reply.choices[0]


def openai_tools_auto(base_url: str, model: str) -> None:
    """`auto` leaves the choice to the model: either answer is well-formed, a call must parse."""
    reply = _chat(
        base_url, model, messages=_user(WEATHER_PROMPT), tools=[WEATHER_TOOL], max_tokens=64
    )
    message = reply.choices[0].message
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id, call
        _check_weather_args(call.function.name, call.function.arguments)
    assert message.tool_calls or isinstance(message.content, str), message


def openai_models(base_url: str, model: str) -> None:
    ids = [m.id for m in _openai(base_url).models.list()]
    assert model in ids, ids


def openai_tools_required_stream(base_url: str, model: str) -> None:
    tools: Any = [WEATHER_TOOL]
    stream = _openai(base_url).chat.completions.create(
        model=model,
        messages=_user(WEATHER_PROMPT),
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # OpenAI's default (true) lets a base model call again
        max_tokens=64,
        stream=True,
    )
    name, arguments = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0, delta  # one call, as parallel_tool_calls=False asks
                if delta.function is not None:
                    name += delta.function.name or ""
                    arguments += delta.function.arguments or ""
    _check_weather_args(name, arguments)


def openai_tool_result(base_url: str, model: str) -> None:
    """The agent loop's second turn: the assistant's call and the tool's answer go back in."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *_user(WEATHER_PROMPT),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = _chat(base_url, model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none")
    assert isinstance(reply.choices[0].message.content, str), reply.choices[0]


def _check_embeddings(data: list[list[float]], count: int) -> None:
    assert len(data) == count, len(data)
    assert len({len(v) for v in data}) == 1 and len(data[0]) > 1, [len(v) for v in data]
    assert all(isinstance(x, float) for x in data[0]), data[0][:4]
    assert data[0] != data[1], "two different inputs got the same vector"


def openai_embeddings(base_url: str, model: str) -> None:
    # The client asks for base64 unless told otherwise and decodes it itself.
    reply = _openai(base_url).embeddings.create(model=model, input=["red apple", "blue sky"])
    assert [d.index for d in reply.data] == [0, 1], reply.data
    _check_embeddings([d.embedding for d in reply.data], 2)


def openai_embeddings_float_base64(base_url: str, model: str) -> None:
    client = _openai(base_url)
    floats = client.embeddings.create(model=model, input="red apple", encoding_format="float")
    raw = client.with_raw_response.embeddings.create(
        model=model, input="red apple", encoding_format="base64"
    )
    packed = json.loads(raw.text)["data"][0]["embedding"]
    assert isinstance(packed, str), type(packed)
    decoded = memoryview(base64.b64decode(packed)).cast("f").tolist()
    vector = floats.data[0].embedding
    assert len(decoded) == len(vector), (len(decoded), len(vector))
    assert max(abs(a - b) for a, b in zip(decoded, vector, strict=True)) < 1e-5


def openai_stop(base_url: str, model: str) -> None:
    """A word from the greedy reply, sent back as a stop string, cuts the reply just before it."""
    prompt = _user("Count from one to twenty in words, separated by commas.")
    full = _chat(base_url, model, messages=prompt, max_tokens=24, temperature=0.0)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[len(words) // 2]
    cut = _chat(base_url, model, messages=prompt, max_tokens=24, temperature=0.0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop", cut.choices[0]
    got = cut.choices[0].message.content
    assert stop not in got and text.startswith(got.rstrip()), (stop, got, text)


def openai_max_tokens(base_url: str, model: str) -> None:
    """`max_tokens` (legacy) and `max_completion_tokens` (its replacement) both cap the reply."""
    prompt = _user("Write a long story about a dragon.")
    for field in ("max_tokens", "max_completion_tokens"):
        cap: dict[str, Any] = {field: 3}
        reply = _openai(base_url).chat.completions.create(
            model=model, messages=prompt, temperature=0.0, **cap
        )
        usage, choice = reply.usage, reply.choices[0]
        assert usage is not None and usage.completion_tokens <= 3, (field, usage)
        if usage.completion_tokens == 3:
            assert choice.finish_reason == "length", (field, choice)


def openai_user(base_url: str, model: str) -> None:
    _chat(base_url, model, user="user-1234", metadata={"team": "edge"})


def openai_system_role(base_url: str, model: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, *_user()]
    _chat(base_url, model, messages=messages)


def openai_developer_role(base_url: str, model: str) -> None:
    messages = [{"role": "developer", "content": "You are terse."}, *_user()]
    _chat(base_url, model, messages=messages)


def openai_seed(base_url: str, model: str) -> None:
    """Sampling at temperature 1 with a seed repeats itself exactly."""
    texts = [
        _chat(base_url, model, temperature=1.0, seed=1234, max_tokens=16).choices[0].message.content
        for _ in range(2)
    ]
    assert texts[0] == texts[1], texts


def openai_completions_list(base_url: str, model: str) -> None:
    reply = _openai(base_url).completions.create(
        model=model, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0.0
    )
    assert sorted(c.index for c in reply.choices) == [0, 1], reply.choices
    assert all(isinstance(c.text, str) for c in reply.choices), reply.choices


def openai_completions_stream(base_url: str, model: str) -> None:
    stream = _openai(base_url).completions.create(
        model=model,
        prompt="The sky is",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices), chunks
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 6, chunks[-1]


def openai_async_stream(base_url: str, model: str) -> None:
    """The async client, as agent frameworks and web apps use it."""

    async def run() -> str:
        client = openai.AsyncOpenAI(
            base_url=v1(base_url), api_key=API_KEY, max_retries=0, timeout=TIMEOUT
        )
        async with client:
            stream = await client.chat.completions.create(
                model=model, messages=_user(), max_tokens=8, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run())


def openai_refusal_names_field(base_url: str, model: str) -> None:
    """Bad input is a 400 whose message names the field (here: temperature out of range)."""
    try:
        _chat(base_url, model, temperature=7.0)
    except openai.BadRequestError as exc:
        assert "temperature" in str(exc), str(exc)
        return
    raise AssertionError("temperature 7.0 was accepted")


# --- LangChain ---------------------------------------------------------------------------------


def _chat_model(base_url: str, model: str, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    kwargs.setdefault("max_tokens", 16)
    return ChatOpenAI(
        base_url=v1(base_url),
        api_key=SecretStr(API_KEY),
        model=model,
        max_retries=0,
        timeout=TIMEOUT,
        **kwargs,
    )


def langchain_invoke(base_url: str, model: str) -> None:
    message = _chat_model(base_url, model).invoke(QUESTION)
    assert isinstance(message.content, str) and message.content, message
    assert message.usage_metadata and message.usage_metadata["output_tokens"] > 0, message


def langchain_stream(base_url: str, model: str) -> None:
    chunks = list(_chat_model(base_url, model).stream(QUESTION))
    assert len(chunks) > 1, chunks
    assert "".join(str(c.content) for c in chunks), chunks


def _structured(base_url: str, model: str, method: str, prompt: str | list[Any]) -> dict[str, Any]:
    llm = _chat_model(base_url, model, max_tokens=120, temperature=0.0)
    runnable = llm.with_structured_output(Capital, method=method, include_raw=True)
    try:
        result: dict[str, Any] = runnable.invoke(prompt)
    except openai.LengthFinishReasonError as exc:  # LangChain calls `parse` for response_format
        if method == "json_mode":
            raise LengthLimit(f"{method}: {exc}") from exc
        raise
    if result["parsing_error"] is not None:
        cut = result["raw"].response_metadata.get("finish_reason") == "length"
        if cut and method == "json_mode":
            raise LengthLimit(f"{method}: {result['raw'].content[:80]!r}")
        raise AssertionError(f"{method}: {result['parsing_error']}")
    return result


def langchain_json_schema(base_url: str, model: str) -> None:
    result = _structured(base_url, model, "json_schema", CAPITAL_PROMPT)
    assert isinstance(result["parsed"], Capital), result


def langchain_json_mode(base_url: str, model: str) -> None:
    result = _structured(base_url, model, "json_mode", CAPITAL_ONE_SHOT)
    # json_mode promises JSON, not the schema: LangChain hands back what parsed.
    assert result["parsed"] is not None, result


def langchain_function_calling(base_url: str, model: str) -> None:
    result = _structured(base_url, model, "function_calling", CAPITAL_PROMPT)
    assert isinstance(result["parsed"], Capital), result


def langchain_bind_tools(base_url: str, model: str) -> None:
    llm = _chat_model(base_url, model, max_tokens=64).bind_tools(
        [WEATHER_TOOL], tool_choice="get_weather"
    )
    message = llm.invoke(WEATHER_PROMPT)
    assert message.tool_calls, message
    _check_weather_args(message.tool_calls[0]["name"], message.tool_calls[0]["args"])


def langchain_completions_llm(base_url: str, model: str) -> None:
    from langchain_openai import OpenAI

    # LangChain's completions class sends the prompt as a one-element list.
    llm = OpenAI(
        base_url=v1(base_url),
        api_key=SecretStr(API_KEY),
        model=model,
        max_tokens=8,
        max_retries=0,
        timeout=TIMEOUT,
    )
    text = llm.invoke("The capital of France is")
    assert isinstance(text, str) and text, text


def langchain_embeddings(base_url: str, model: str) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send text; else LangChain tokenises with OpenAI's
    # tiktoken vocabulary (downloaded from the internet), which is not this model's.
    embeddings = OpenAIEmbeddings(
        base_url=v1(base_url),
        api_key=SecretStr(API_KEY),
        model=model,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    _check_embeddings(embeddings.embed_documents(["red apple", "blue sky"]), 2)
    assert len(embeddings.embed_query("green grass")) > 1


# --- LiteLLM -----------------------------------------------------------------------------------


def _litellm(base_url: str, model: str, **kwargs: Any) -> Any:
    import litellm

    litellm.suppress_debug_info = True  # else each error prints a feedback banner to stdout

    kwargs.setdefault("messages", _user())
    kwargs.setdefault("max_tokens", 16)
    return litellm.completion(
        model=f"openai/{model}",
        api_base=v1(base_url),
        api_key=API_KEY,
        num_retries=0,
        timeout=TIMEOUT,
        **kwargs,
    )


def litellm_completion(base_url: str, model: str) -> None:
    reply = _litellm(base_url, model)
    assert isinstance(reply.choices[0].message.content, str), reply
    assert reply.usage.completion_tokens > 0, reply.usage


def litellm_stream(base_url: str, model: str) -> None:
    chunks = list(_litellm(base_url, model, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def litellm_top_k(base_url: str, model: str) -> None:
    reply = _litellm(base_url, model, top_k=40)
    assert isinstance(reply.choices[0].message.content, str), reply


def litellm_tools(base_url: str, model: str) -> None:
    reply = _litellm(
        base_url,
        model,
        messages=_user(WEATHER_PROMPT),
        tools=[WEATHER_TOOL],
        tool_choice=NAMED_TOOL,
        max_tokens=64,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls, reply.choices[0].message
    _check_weather_args(calls[0].function.name, calls[0].function.arguments)


def litellm_embedding(base_url: str, model: str) -> None:
    import litellm

    litellm.suppress_debug_info = True

    reply = litellm.embedding(
        model=f"openai/{model}",
        api_base=v1(base_url),
        api_key=API_KEY,
        input=["red apple", "blue sky"],
        timeout=TIMEOUT,
    )
    _check_embeddings([d["embedding"] for d in reply.data], 2)


CASES: list[Case] = [
    Case("openai", "chat", openai_chat),
    Case("openai", "stream include_usage", openai_stream_usage),
    Case("openai", "logprobs top 3", openai_logprobs),
    Case("openai", "n=2", openai_n2),
    Case("openai", "parse (pydantic)", openai_parse),
    Case("openai", "json_object", openai_json_object),
    Case("openai", "models list", openai_models),
    Case("openai", "tools auto", openai_tools_auto),
    Case("openai", "tools (named)", openai_tools, tool_choice_object=True),
    Case("openai", "tools required, streamed", openai_tools_required_stream),
    Case("openai", "tool result turn", openai_tool_result),
    Case("openai", "embeddings", openai_embeddings, embed=True),
    Case("openai", "embeddings float = base64", openai_embeddings_float_base64, embed=True),
    Case("openai", "stop sequence", openai_stop),
    Case("openai", "max_tokens / max_completion_tokens", openai_max_tokens),
    Case("openai", "user + metadata", openai_user),
    Case("openai", "system role", openai_system_role),
    Case("openai", "developer role", openai_developer_role),
    Case("openai", "seed determinism", openai_seed),
    Case("openai", "completions prompt list", openai_completions_list),
    Case("openai", "completions stream include_usage", openai_completions_stream),
    Case("openai", "async client stream", openai_async_stream),
    Case("openai", "400 names the field", openai_refusal_names_field),
    Case("langchain", "ChatOpenAI invoke", langchain_invoke),
    Case("langchain", "ChatOpenAI stream", langchain_stream),
    Case("langchain", "structured json_schema", langchain_json_schema),
    Case("langchain", "structured json_mode", langchain_json_mode),
    Case(
        "langchain",
        "structured function_calling",
        langchain_function_calling,
        tool_choice_object=True,  # LangChain names the schema's function
    ),
    Case("langchain", "bind_tools", langchain_bind_tools, tool_choice_object=True),
    Case("langchain", "OpenAI (completions LLM)", langchain_completions_llm),
    Case("langchain", "OpenAIEmbeddings", langchain_embeddings, embed=True),
    Case("litellm", "completion", litellm_completion),
    Case("litellm", "stream", litellm_stream),
    Case("litellm", "top_k", litellm_top_k),
    Case("litellm", "tools (named)", litellm_tools, tool_choice_object=True),
    Case("litellm", "embedding", litellm_embedding, embed=True),
]


def cases_of(client: str) -> list[Case]:
    return [case for case in CASES if case.client == client]
