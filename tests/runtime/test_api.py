"""The HTTP contract around generation: errors, overload, cancellation, admin, auth, probes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.runtime.conftest import API_KEY, CAPACITY, CONTEXT, LiveServer
from tests.support.waiting import wait_async

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 5, "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": [], "max_tokens": 4}, "prompt"),
        ({"prompt": [1, 99999999], "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 4}, "prompt"),
    ],
)
async def test_bad_completion_requests_are_400(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.post("/v1/completions", json=body)
    assert_openai_error(response, 400, param)


async def test_bad_chat_and_json_are_400(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        broken = await client.post(
            "/v1/completions",
            content=b'{"prompt": "hi",',
            headers={"content-type": "application/json"},
        )
        no_messages = await client.post("/v1/chat/completions", json={"messages": []})
        bad_role = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}
        )
        too_long = await client.post(
            "/v1/completions", json={"prompt": "word " * (CONTEXT + 10), "max_tokens": 1}
        )
        huge = await client.post("/v1/completions", content=b"x" * (2 << 20))
    assert_openai_error(broken, 400)
    assert broken.json()["error"]["code"] == "invalid_json"
    assert_openai_error(no_messages, 400, "messages")
    assert_openai_error(bad_role, 400)
    assert_openai_error(too_long, 400, "prompt")
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert_openai_error(huge, 413)


async def test_unknown_route_is_openai_404(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.get("/v1/nothing")
    assert_openai_error(response, 404)


async def test_disconnect_frees_the_slot(server: LiveServer) -> None:
    engine = server.state.engine
    body = {"prompt": "Tell me a very long story.", "max_tokens": 400, "temperature": 0}
    streaming = {**body, "stream": True}
    async with (
        httpx.AsyncClient(base_url=server.url) as client,
        client.stream("POST", "/v1/completions", json=streaming) as r,
    ):
        got = 0
        async for line in r.aiter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
        assert engine.state().active == 1
    # leaving the block closed the connection mid-stream
    await wait_async("the slot freed", lambda: engine.state().active == 0, timeout=5)

    # the same for a non-streaming request whose client gives up
    async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body)
    await wait_async("the slot freed", lambda: engine.state().active == 0, timeout=5)
    async with httpx.AsyncClient(base_url=server.url) as client:
        metrics = (await client.get("/metrics")).text
    assert 'ember_generations_finished_total{reason="cancelled"}' in metrics


async def test_admin_batch_changes_sequences_per_step(server: LiveServer) -> None:
    prompts = ["One", "Two", "Three"]

    async def run_and_watch(client: httpx.AsyncClient) -> set[int]:
        seen: set[int] = set()
        jobs = [
            client.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0})
            for p in prompts
        ]
        task = asyncio.ensure_future(asyncio.gather(*jobs))
        while not task.done():
            state = (await client.get("/admin/state")).json()
            if state["activeSequences"]:
                seen.add(state["lastStepSequences"])
            await asyncio.sleep(0.01)
        assert all(r.status_code == 200 for r in await task)
        return seen

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        narrowed = await client.put("/admin/batch", json={"maxBatchSize": 1})
        assert narrowed.status_code == 200
        assert narrowed.json()["maxBatchSize"] == 1
        single = await run_and_watch(client)
        widened = await client.put("/admin/batch", json={"maxBatchSize": 3})
        assert widened.json()["maxBatchSize"] == 3
        multi = await run_and_watch(client)
        bad = [
            await client.put("/admin/batch", json={"maxBatchSize": v})
            for v in (0, CAPACITY + 1, "4")
        ]
        await client.put("/admin/batch", json={"maxBatchSize": CAPACITY})
        metrics = (await client.get("/metrics")).text
    assert single == {1}
    assert max(multi) == 3
    for response in bad:
        assert_openai_error(response, 400)
    assert f"ember_max_batch_size {float(CAPACITY)}" in metrics


async def test_flood_gets_429_with_retry_after(guarded: LiveServer) -> None:
    body = {"prompt": "Count to one hundred:", "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client:
        await client.put("/admin/batch", json={"maxBatchSize": 1})
        try:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(8))
            )
        finally:
            await client.put("/admin/batch", json={"maxBatchSize": CAPACITY})
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(429) >= 1, statuses
    assert statuses.count(200) >= 3, statuses  # one running + two queued at least
    rejected = next(r for r in responses if r.status_code == 429)
    assert_openai_error(rejected, 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "rate_limit_error"


async def test_request_timeout_is_504(guarded: LiveServer) -> None:
    body = {"prompt": "Write an essay.", "max_tokens": 400, "temperature": 0}
    state = guarded.state
    saved, state.request_timeout = state.request_timeout, 0.5  # read per request
    try:
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client:
            response = await client.post("/v1/completions", json=body)
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
    finally:
        state.request_timeout = saved
    assert_openai_error(response, 504)
    assert streamed.status_code == 200  # headers were sent; the error arrives as an event
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert '"code": "timeout"' in events[-2]
    assert events[-1] == "data: [DONE]"
    await wait_async("the slot freed", lambda: state.engine.state().active == 0, timeout=5)


async def test_api_key_protects_admin_and_api(guarded: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=guarded.url) as client:
        anonymous = await client.get("/admin/state")
        wrong = await client.put(
            "/admin/batch", json={"maxBatchSize": 2}, headers={"Authorization": "Bearer nope"}
        )
        models_anonymous = await client.get("/v1/models")
        allowed = await client.get("/admin/state", headers=AUTH)
        health = await client.get("/healthz")
    assert_openai_error(anonymous, 401)
    assert_openai_error(wrong, 401)
    assert_openai_error(models_anonymous, 401)
    assert allowed.status_code == 200
    assert allowed.json()["maxBatchSize"] == CAPACITY  # the rejected PUT changed nothing
    assert health.status_code == 200


async def test_probes_models_metrics_and_temperature(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        health = await client.get("/healthz")
        ready = await client.get("/readyz")
        models = (await client.get("/v1/models")).json()
        await wait_async("a temperature", lambda: bool(server.state.temperatures))
        state = (await client.get("/admin/state")).json()
        metrics = (await client.get("/metrics")).text
    assert health.status_code == 200
    assert ready.status_code == 200
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "gemma-3-270m"
    assert state["temperatures"] == {"cpu-thermal": 47.25}
    assert state["capacity"] == CAPACITY
    for name in (
        "ember_time_to_first_token_seconds_count",
        "ember_inter_token_latency_seconds_count",
        "ember_generated_tokens_total",
        "ember_engine_step_seconds_count",
        "ember_queue_depth",
        "ember_active_sequences",
        'ember_requests_total{endpoint="/v1/completions",status="200"}',
        'ember_device_temperature_celsius{sensor="cpu-thermal"} 47.25',
    ):
        assert name in metrics, name
