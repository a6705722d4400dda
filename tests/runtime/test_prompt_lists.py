"""`/v1/completions` takes every prompt form OpenAI allows, through the `openai` client on the
real engine: a string, token ids, a list of strings, a list of token-id lists; one choice per
prompt, in order, `index` matching (LangChain's `OpenAI` class sends a one-element list); and
`n` samples of each."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import httpx
import pytest

from tests.runtime.conftest import LiveServer
from tests.runtime.test_openai_params import MODEL, api

PROMPTS = ["The capital of France is", "One, two, three,", "Roses are red,"]


async def test_a_list_of_strings_gets_one_choice_per_prompt_in_order(server: LiveServer) -> None:
    async with api(server) as client:
        reply = await client.completions.create(
            model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, echo=True
        )
        alone = await client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0
        )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, reply.choices, strict=True):
        assert choice.text.startswith(prompt)  # echo: each choice is its own prompt's
        assert choice.finish_reason in ("length", "stop")
    assert reply.usage is not None and alone.usage is not None
    per_prompt = [len(server.state.engine.tokenize(p, add_special=True)) for p in PROMPTS]
    assert reply.usage.prompt_tokens == sum(per_prompt)
    reasons = [c.finish_reason for c in reply.choices]
    assert _completion_bounds(reasons, 4, reply.usage.completion_tokens)


def _completion_bounds(reasons: Sequence[str], max_tokens: int, total: int) -> bool:
    """A choice cut by max_tokens made exactly that many tokens; one that stopped, fewer."""
    cut = sum(1 for reason in reasons if reason == "length")
    return cut * max_tokens <= total <= len(reasons) * max_tokens


async def test_token_id_prompts_one_and_many(server: LiveServer) -> None:
    ids = [server.state.engine.tokenize(p, add_special=True) for p in PROMPTS]
    async with api(server) as client:
        one = await client.completions.create(model=MODEL, prompt=ids[0], max_tokens=3)
        many = await client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert len(one.choices) == 1
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage is not None and many.usage.prompt_tokens == sum(map(len, ids))


async def test_a_streamed_list_carries_every_index_and_one_usage(server: LiveServer) -> None:
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    usages = []
    async with api(server) as client:
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk.usage)
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1, 2]
    assert len(usages) == 1
    assert _completion_bounds(list(finished.values()), 5, usages[0].completion_tokens)
    assert all(texts[i] for i in range(3))
    assert usages[0].prompt_tokens == sum(
        len(server.state.engine.tokenize(p, add_special=True)) for p in PROMPTS
    )


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), ([""], "prompt"), ([[]], "prompt"), (["x"] * 65, "prompt")],
    ids=["empty-list", "empty-string", "empty-ids", "too-many"],
)
async def test_bad_prompt_lists_are_a_400_naming_prompt(
    server: LiveServer, prompt: object, param: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_n_samples_per_prompt_in_openai_order(server: LiveServer) -> None:
    async with api(server) as client:
        reply = await client.completions.create(
            model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=1.0, seed=7, echo=True
        )
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4
        )
    assert [c.index for c in reply.choices] == list(range(6))
    for i, choice in enumerate(reply.choices):
        assert choice.text.startswith(PROMPTS[i // 3])  # index = prompt x n + sample
    texts = [c.text for c in reply.choices]
    # seed + j per sample: not n copies of one draw (both prompts alike would be ~1e-6)
    assert len(set(texts[:3])) > 1 or len(set(texts[3:])) > 1
    assert [c.index for c in chat.choices] == [0, 1]


async def test_n_times_prompts_is_bounded(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 22}
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
