"""Generation through the real engine over HTTP: determinism, batching, streaming, stops, chat."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.runtime.conftest import LiveServer

PROMPTS = [
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The capital of France is Paris. The capital of Germany is",
    "List of prime numbers: 2, 3, 5, 7,",
]


async def complete(client: httpx.AsyncClient, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    response = await client.post("/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def stream_text(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[str, str | None, list[dict[str, Any]]]:
    chunks: list[dict[str, Any]] = []
    async with client.stream("POST", path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text, reason = "", None
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            reason = choice["finish_reason"] or reason
    return text, reason, chunks


async def test_greedy_is_deterministic(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        first = await complete(client, PROMPTS[0])
        second = await complete(client, PROMPTS[0])
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["text"].strip()
    assert first["usage"]["completion_tokens"] == 24
    assert first["choices"][0]["finish_reason"] == "length"


async def test_staggered_requests_all_complete(server: LiveServer) -> None:
    # The default (fast) mode: requests join mid-generation and all get their full answers.
    # Batch-independent text is deterministic mode's promise (tests/runtime/test_batching.py).
    async with httpx.AsyncClient(base_url=server.url) as client:

        async def late(prompt: str, delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)  # joins while the others are mid-generation
            return await complete(client, prompt)

        together = await asyncio.gather(*(late(p, 0.1 * i) for i, p in enumerate(PROMPTS[:4])))
    for batched in together:
        assert batched["choices"][0]["text"].strip()
        assert batched["usage"]["completion_tokens"] == 24


async def test_batched_steps_really_hold_several_sequences(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        seen: set[int] = set()
        work = asyncio.gather(*(complete(client, p, max_tokens=32) for p in PROMPTS[:4]))
        task = asyncio.ensure_future(work)
        while not task.done():
            seen.add(server.state.engine.state().last_step_sequences)
            await asyncio.sleep(0.005)
        await task
    assert max(seen) >= 3  # continuous batching: several sequences per llama_decode


async def test_streaming_matches_non_streaming(server: LiveServer) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url) as client:
        whole = await complete(client, PROMPTS[1], max_tokens=20)
        text, reason, chunks = await stream_text(client, "/v1/completions", body)
    assert text == whole["choices"][0]["text"]
    assert reason == whole["choices"][0]["finish_reason"] == "length"
    assert len(chunks) > 5  # really streamed, token by token
    assert all(c["object"] == "text_completion" for c in chunks)


async def test_stream_usage_when_asked(server: LiveServer) -> None:
    body = {
        "prompt": PROMPTS[2],
        "max_tokens": 8,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=server.url) as client:
        _, _, chunks = await stream_text(client, "/v1/completions", body)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


async def test_stop_strings(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        free = (await complete(client, PROMPTS[3], max_tokens=30))["choices"][0]["text"]
        words = free.split()
        assert len(words) >= 4, free
        stop = words[2]
        cut = free.index(stop)
        stopped = await complete(client, PROMPTS[3], max_tokens=30, stop=[stop, "zzzz-never"])
        body = {"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "stop": stop}
        streamed, reason, _ = await stream_text(client, "/v1/completions", body)
    assert stopped["choices"][0]["text"] == free[:cut]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert streamed == free[:cut]
    assert reason == "stop"


async def test_chat_template_comes_from_the_model(server: LiveServer) -> None:
    from ember_runtime.engines.base import ChatMessage

    # This GGUF carries no Jinja template (tokenizer.chat_template is absent), so the engine
    # uses llama.cpp's built-in template for the architecture the metadata declares (gemma3):
    # Gemma's turn markers, with the system prompt folded into the first user turn.
    rendered = server.state.engine.render_chat(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    )
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    )

    messages = [{"role": "user", "content": "Name one fruit."}]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.post("/v1/chat/completions", json=body, timeout=120)
        text, reason, chunks = await stream_text(client, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    message = data["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"].strip()
    assert "<end_of_turn>" not in message["content"]  # the turn end stops, it is not text
    one_turn = "<bos><start_of_turn>user\nName one fruit.<end_of_turn>\n<start_of_turn>model\n"
    expected = server.state.engine.tokenize(one_turn, add_special=False)
    assert expected[0] == 2  # <bos> parsed as the special token, not as text
    assert data["usage"]["prompt_tokens"] == len(expected)
    assert text == message["content"]
    assert reason == data["choices"][0]["finish_reason"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_openai_client_works(server: LiveServer) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["gemma-3-270m"]
    completion = await client.completions.create(
        model="gemma-3-270m", prompt=PROMPTS[0], max_tokens=6, temperature=0
    )
    assert completion.choices[0].text
    stream = await client.chat.completions.create(
        model="gemma-3-270m",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts)
    await client.close()


async def test_sampling_with_seed_is_reproducible(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        runs = [
            await complete(client, PROMPTS[1], temperature=0.9, top_p=0.95, seed=seed)
            for seed in (7, 7, 8)
        ]
    texts = [r["choices"][0]["text"] for r in runs]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
