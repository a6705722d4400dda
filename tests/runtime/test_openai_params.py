"""Every OpenAI parameter is honoured or refused, through the `openai` client on the real engine.

response_format (json_object, json_schema) runs through llama.cpp's grammar sampler; logprobs
come from the model's logits; echo prefixes the prompt; anything not implemented is a 400 that
names the parameter; user/metadata pass (they change nothing here).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.runtime.conftest import LiveServer

MODEL = "gemma-3-270m"
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": 'Give me a JSON object with the key "color".'}
]
# What may follow a cut-off JSON text (mid-string, mid-number, mid-literal, after a key, a
# colon or a comma) so that closing its brackets makes it whole.
_TAILS = ("", '"', "0", "null", "e", "ue", "rue", "se", "lse", "alse", "l", "ll", "ull", 'n"')
_JOINS = ("", ":0", '":0', '"k":0', '"":0')


def _closers(text: str) -> str:
    """The brackets still open in a JSON text, outside strings, closed in order."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return "".join(reversed(stack))


def completes_to_object(text: str) -> bool:
    """True when text, cut anywhere, is the start of a JSON object: some tail makes it one.

    A found completion proves the prefix valid, so this never passes free text.
    """
    for tail in _TAILS:
        for join in _JOINS:
            whole = text + tail + join
            with contextlib.suppress(ValueError):
                if isinstance(json.loads(whole + _closers(whole)), dict):
                    return True
    return False


@contextlib.asynccontextmanager
async def api(server: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    # Made in each test: the client belongs to the test's event loop.
    async with AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180
    ) as client:
        yield client


async def chat(client: AsyncOpenAI, **extra: Any) -> Any:
    return await client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, **extra)


def test_prefix_check_tells_json_objects_from_free_text() -> None:
    for cut in ('{"a": [1, 2', '{"a": "x\\', '{"a": tr', '{"a"', '{"a": 1,', '{"a": {"b": -1.'):
        assert completes_to_object(cut), cut
    for text in ("Sure! Here", '["a"]', '{"a": 1}}', '{"a" 1', "{'a': 1"):
        assert not completes_to_object(text), text


async def test_json_object_reply_is_a_json_object(server: LiveServer) -> None:
    # A 270M base model often nests objects until max_tokens, and where it stops depends on
    # the CPU's kernels; what the grammar guarantees does not: every token keeps the reply a
    # JSON object, closed (finish "stop", the grammar ends it there) or cut at max_tokens.
    async with api(server) as client:
        reply = await chat(client, max_tokens=48, response_format={"type": "json_object"})
        choice, content = reply.choices[0], reply.choices[0].message.content or ""
        assert content.lstrip().startswith("{"), content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert (choice.finish_reason, reply.usage.completion_tokens) == ("length", 48)
            assert completes_to_object(content), content


async def test_json_schema_reply_follows_the_schema(server: LiveServer) -> None:
    # Keys the model would never pick for this question: only the grammar puts them there.
    async with api(server) as client:
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "legs": {"type": "integer"},
                "indoor": {"type": "boolean"},
            },
            "required": ["name", "legs", "indoor"],
            "additionalProperties": False,
        }
        reply = await chat(
            client,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "cat", "schema": schema, "strict": True},
            },
        )
        # Bounded by the schema (a 12-character name, an integer of at most 16 digits, a
        # boolean), so on any CPU the grammar closes the object and ends the reply there.
        assert reply.choices[0].finish_reason == "stop"
        data = json.loads(reply.choices[0].message.content or "")
        assert set(data) == {"name", "legs", "indoor"}
        assert isinstance(data["name"], str) and len(data["name"]) <= 12
        assert isinstance(data["legs"], int) and isinstance(data["indoor"], bool)


async def test_chat_logprobs_describe_the_greedy_tokens(server: LiveServer) -> None:
    async with api(server) as client:
        reply = await chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
        content = reply.choices[0].logprobs.content
        assert reply.usage is not None and len(content) == reply.usage.completion_tokens == 8
        assert "".join(t.token for t in content) == reply.choices[0].message.content
        for entry in content:
            assert len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and tops[0] <= 0.0
            assert entry.logprob == pytest.approx(tops[0])  # greedy takes the likeliest token
            assert entry.token == entry.top_logprobs[0].token
            assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token
        # without logprobs there are none
        plain = await chat(client, max_tokens=8)
        assert plain.choices[0].logprobs is None


async def test_streamed_chat_logprobs_match_the_whole_reply(server: LiveServer) -> None:
    async with api(server) as client:
        whole = await chat(client, max_tokens=8, logprobs=True, top_logprobs=2)
        stream = await chat(client, max_tokens=8, logprobs=True, top_logprobs=2, stream=True)
        tokens: list[tuple[str, float]] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens += [(t.token, t.logprob) for t in chunk.choices[0].logprobs.content or []]
        expected = [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
        assert tokens == expected


async def test_completion_logprobs_and_echo(server: LiveServer) -> None:
    async with api(server) as client:
        prompt = "The three primary colors are"
        scored = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2
        )
        choice = scored.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert lp.text_offset is not None
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert math.isclose(logprob, max(top.values()), abs_tol=1e-5)
            assert top[token] == pytest.approx(logprob)
        echoed = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True
        )
        assert echoed.choices[0].text == prompt + choice.text
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
        )
        assert (
            "".join([c.choices[0].text async for c in stream if c.choices]) == prompt + choice.text
        )


async def test_labels_pass(server: LiveServer) -> None:
    async with api(server) as client:
        reply = await chat(client, max_tokens=4, user="device-17", metadata={"site": "edge-lab"})
        assert reply.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # tools are served (test_tool_calls.py); a malformed one is refused by name
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools.0.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        # llama-server's samplers that are not implemented here (docs/sampling.md)
        ({"extra_body": {"mirostat": 2}}, "mirostat"),
        ({"extra_body": {"dry_multiplier": 0.8}}, "dry_multiplier"),
        ({"extra_body": {"xtc_probability": 0.5}}, "xtc_probability"),
        ({"extra_body": {"top_n_sigma": 1.0}}, "top_n_sigma"),
        ({"extra_body": {"dynatemp_range": 0.5}}, "dynatemp_range"),
        ({"extra_body": {"samplers": ["top_k", "temperature"]}}, "samplers"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),  # not a token of this vocabulary
        ({"extra_body": {"logit_bias": [[1, True]]}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
async def test_unimplemented_chat_parameters_are_400(
    server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    async with api(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await chat(client, max_tokens=4, **extra)
        assert info.value.param == param, info.value.body


async def test_llama_server_sampling_fields_are_honoured(server: LiveServer) -> None:
    """What Open WebUI and LangChain's/LiteLLM's llama.cpp adapters send passes, and a switched
    -off sampler's tuning knob changes nothing."""
    fields = {
        "top_k": 40,
        "min_p": 0.05,
        "typical_p": 0.95,
        "repeat_penalty": 1.1,
        "repeat_last_n": -1,
        "min_keep": 2,
        "ignore_eos": True,
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "dry_base": 1.75,
    }
    async with api(server) as client:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=6,
            temperature=0.8,
            top_p=0.95,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body=fields,
        )
        # ignore_eos: the reply runs to max_tokens whatever the model would end with
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 6


async def test_logit_bias_refuses_infinity(server: LiveServer) -> None:
    """Python's JSON (and so the server's) reads Infinity; the openai client will not send it."""
    body = b'{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": Infinity}}'
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        reply = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "logit_bias"


async def test_logit_bias_moves_the_greedy_choice(server: LiveServer) -> None:
    """Banning the greedy token (OpenAI's -100 by id, llama-server's false by text) leaves the
    runner-up; +100 on another token makes it the choice."""
    tokenize = server.state.engine.tokenize
    async with api(server) as client:

        async def first(**extra: Any) -> str:
            reply = await client.completions.create(
                model=MODEL, prompt="Monday, Tuesday,", max_tokens=1, temperature=0, **extra
            )
            return str(reply.choices[0].text)

        best = await first()
        (best_id,) = tokenize(best, add_special=False)
        runner_up = await first(logit_bias={str(best_id): -100})
        assert runner_up != best
        assert await first(extra_body={"logit_bias": [[best, False]]}) == runner_up
        (sunday,) = tokenize(" Sunday", add_special=False)
        assert await first(logit_bias={str(sunday): 100}) == " Sunday"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"echo": True, "logprobs": 1}, "echo"),
    ],
)
async def test_unimplemented_completion_parameters_are_400(
    server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    async with api(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, **extra)
        assert info.value.param == param, info.value.body
