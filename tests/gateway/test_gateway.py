"""The gateway in front of real runtimes (real engine, real model) over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from ember_runtime.gateway.app import create_app
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.metrics import GatewayMetrics
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.conftest import (
    ALPHA_KEY,
    BETA_KEY,
    POLICY,
    CutRelay,
    Gateway,
    generations,
    host,
    prompt_preferring,
    route,
    served_by,
    start_gateway,
    start_replica,
)
from tests.runtime.conftest import LiveServer, start_live
from tests.support.waiting import wait_for

ALPHA = {"Authorization": f"Bearer {ALPHA_KEY}"}


def complete(gw: Gateway, prompt: str, max_tokens: int = 2, **extra: object) -> httpx.Response:
    body = {"model": "alpha", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{gw.url}/v1/completions", json=body, headers=ALPHA, timeout=120)


def raw(url: str, request: bytes) -> bytes:
    """One request written byte for byte (no client normalises the path or the headers)."""
    host_, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host_, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_models_lists_every_model(gateway: Gateway) -> None:
    listed = httpx.get(f"{gateway.url}/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ALPHA_KEY)
    assert {m.id for m in client.models.list()} == {"alpha", "beta"}


def test_an_unknown_model_is_a_404_in_openai_shape(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ALPHA_KEY)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    bad = httpx.post(f"{gateway.url}/v1/completions", content=b"[1]", headers=ALPHA)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_client_uses_both_models_stream_and_not(gateway: Gateway) -> None:
    for model, key in (("alpha", ALPHA_KEY), ("beta", BETA_KEY)):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        assert reply.model == model and reply.choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=4,
                stream=True,
            )
        )
        assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason is not None
        text = client.completions.create(model=model, prompt="The sky is", max_tokens=3)
        assert text.choices[0].text


def test_a_key_opens_only_its_own_model(gateway: Gateway, replicas: list[LiveServer]) -> None:
    beta = replicas[2]
    before = generations(beta)
    body = {"model": "beta", "prompt": "hi", "max_tokens": 2}
    for headers in (ALPHA, {}, {"Authorization": "Basic " + BETA_KEY}, {"Authorization": "Bearer"}):
        got = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers)
        assert got.status_code == 401, headers
        assert got.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ALPHA_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert generations(beta) == before  # not one request reached beta's replica
    ok = httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {BETA_KEY}"}
    )
    assert ok.status_code == 200 and generations(beta) == before + 1


@pytest.mark.parametrize(
    "line",
    [
        b"GET /admin/state HTTP/1.1",
        b"PUT /admin/batch HTTP/1.1",
        b"GET /v1/../admin/state HTTP/1.1",
        b"GET /v1/models/../../admin/state HTTP/1.1",
        b"POST /v1/completions/../../admin/batch HTTP/1.1",
        b"GET //admin/state HTTP/1.1",
        b"GET http://127.0.0.1/admin/state HTTP/1.1",
        b"GET /v1/%2e%2e/admin/state HTTP/1.1",
    ],
)
def test_replica_admin_is_not_reachable_through_the_gateway(gateway: Gateway, line: bytes) -> None:
    body = b'{"maxBatchSize": 1}'
    head = b"\r\n".join(
        [
            line,
            b"Host: x",
            b"Authorization: Bearer " + ALPHA_KEY.encode(),
            b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode(),
            b"Connection: close",
        ]
    )
    reply = raw(gateway.url, head + b"\r\n\r\n" + body)
    status = int(reply.split(b" ", 2)[1])
    assert status in (404, 405), reply[:200]
    assert b"maxBatchSize" not in reply and b"activeSequences" not in reply


def test_client_headers_and_names_cannot_be_injected(gateway: Gateway) -> None:
    # a model name with a header in it is just an unknown name
    body = json.dumps({"model": "alpha\r\nX-Injected: 1", "prompt": "hi"}).encode()
    reply = raw(
        gateway.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body,
    )
    assert reply.startswith(b"HTTP/1.1 404") and b"X-Injected" not in reply.split(b"\r\n\r\n")[0]
    # two Authorization headers: the first decides, a second cannot smuggle another model's key
    body = json.dumps({"model": "beta", "prompt": "hi", "max_tokens": 1}).encode()
    reply = raw(
        gateway.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + ALPHA_KEY.encode() + b"\r\n"
        b"Authorization: Bearer " + BETA_KEY.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body,
    )
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


def test_headroom_sends_work_around_a_busy_replica(
    gateway: Gateway, replicas: list[LiveServer]
) -> None:
    a0, a1 = replicas[0], replicas[1]
    body = {"model": "alpha", "prompt": "Count to a thousand:", "max_tokens": 400, "stream": True}

    async def occupy() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [
                client.stream("POST", f"{a0.url}/v1/completions", json=body, headers=ALPHA)
                for _ in range(2)
            ]
            responses = [await s.__aenter__() for s in streams]
            await asyncio.to_thread(
                gateway.wait_probed,
                lambda f: (
                    next(r for r in f.replicas("alpha") if host(a0) in r.backend.key).active >= 2
                ),
            )
            chosen = [served_by(await asyncio.to_thread(complete, gateway, "Hi")) for _ in range(3)]
            for s in streams:
                await s.__aexit__(None, None, None)
            del responses
            return chosen

    assert asyncio.run(occupy()) == [host(a1)] * 3


def test_a_throttled_replica_is_avoided(gateway: Gateway, replicas: list[LiveServer]) -> None:
    a0, a1 = replicas[0], replicas[1]
    lowered = httpx.put(f"{a0.url}/admin/batch", json={"maxBatchSize": 1}, headers=ALPHA)
    assert lowered.status_code == 200
    try:
        gateway.wait_probed(
            lambda f: any(
                r.batch_limit == 1 for r in f.replicas("alpha") if host(a0) in r.backend.key
            )
        )
        # long, different prompts: prefix affinity alone would spread them over both
        chosen = [
            served_by(complete(gateway, f"Topic {i}: " + "tell me more. " * 8)) for i in range(6)
        ]
        assert chosen == [host(a1)] * 6
    finally:
        httpx.delete(f"{a0.url}/admin/batch", headers=ALPHA)
    gateway.wait_probed(lambda f: all(r.batch_limit == 4 for r in f.replicas("alpha")))


def test_a_shared_prefix_stays_on_one_replica_until_it_is_loaded(gateway: Gateway) -> None:
    prefix = "System: you are the site's help desk. Answer politely and briefly. " * 2
    alone = {served_by(complete(gateway, prefix + f"Question {i}?")) for i in range(4)}
    assert len(alone) == 1  # one at a time: always the replica holding the prefix

    async def burst() -> Counter[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "alpha", "max_tokens": 24, "temperature": 0}
            replies = await asyncio.gather(
                *(
                    client.post(
                        f"{gateway.url}/v1/completions",
                        json={**body, "prompt": prefix + f"Q{i}?"},
                        headers=ALPHA,
                    )
                    for i in range(6)
                )
            )
        assert all(r.status_code == 200 for r in replies)
        return Counter(served_by(r) for r in replies)

    spread = asyncio.run(burst())
    assert len(spread) == 2, spread  # bounded load: the hot prefix spilled to the other replica
    assert spread[next(iter(alone))] >= 3  # ...and its home kept the larger share


def test_failover_before_the_first_byte_on_a_reset(replicas: list[LiveServer]) -> None:
    a0, a1 = replicas[0], replicas[1]
    relay = CutRelay(host(a0), cut_before_reply=True)
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, relay.url, a1.url)})
    try:
        before = generations(a0)
        reply = complete(gw, prompt_preferring([relay.url, a1.url], relay.url))
        assert reply.status_code == 200 and served_by(reply) == host(a1)
        assert gw.counter("ember_gateway_retries", model="alpha", cause="reset") == 1
        assert generations(a0) == before  # the reset came before the replica saw the request
    finally:
        gw.stop()
        relay.close()


def test_failover_on_a_full_queue_429(replicas: list[LiveServer], tmp_path: Path) -> None:
    a1 = replicas[1]
    full = start_replica(tmp_path / "q", "alpha", ALPHA_KEY, maxQueue=1)
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, full.url, a1.url)}, interval=60)
    body = {"model": "alpha", "prompt": "Count slowly:", "max_tokens": 400, "stream": True}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [
                client.stream("POST", f"{full.url}/v1/completions", json=body, headers=ALPHA)
                for _ in range(5)  # 4 slots + 1 waiting: the replica's next request is a 429
            ]
            for s in streams:
                assert (await s.__aenter__()).status_code == 200
            direct = await client.post(f"{full.url}/v1/completions", json=body, headers=ALPHA)
            assert direct.status_code == 429
            # the gateway's last probe (at start) saw `full` idle: it tries it first
            prompt = prompt_preferring([full.url, a1.url], full.url)
            reply = await asyncio.to_thread(complete, gw, prompt)
            for s in streams:
                await s.__aexit__(None, None, None)
            return reply

    try:
        reply = asyncio.run(run())
        assert reply.status_code == 200 and served_by(reply) == host(a1)
        assert gw.counter("ember_gateway_retries", model="alpha", cause="429") == 1
    finally:
        gw.stop()
        full.stop()


def test_failover_when_a_replica_is_killed(replicas: list[LiveServer], tmp_path: Path) -> None:
    a1 = replicas[1]
    doomed = start_replica(tmp_path / "k", "alpha", ALPHA_KEY)
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, doomed.url, a1.url)}, interval=60)
    try:
        doomed.stop()  # the gateway's probes (every 60 s here) have not seen it go
        prompt = prompt_preferring([doomed.url, a1.url], doomed.url)
        reply = complete(gw, prompt)
        assert reply.status_code == 200 and served_by(reply) == host(a1)
        assert gw.counter("ember_gateway_retries", model="alpha", cause="connect") == 1
        assert not next(
            r for r in gw.fleet.replicas("alpha") if r.backend.url == doomed.url
        ).healthy
    finally:
        gw.stop()


def test_nothing_is_retried_after_the_first_byte(replicas: list[LiveServer]) -> None:
    a0, a1 = replicas[0], replicas[1]
    relay = CutRelay(host(a0))
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, relay.url, a1.url)})
    try:
        before = generations(a1)
        prompt = prompt_preferring([relay.url, a1.url], relay.url)
        body = {"model": "alpha", "prompt": prompt, "max_tokens": 300, "stream": True}
        got: list[bytes] = []
        with (
            pytest.raises(httpx.HTTPError),
            httpx.stream(
                "POST", f"{gw.url}/v1/completions", json=body, headers=ALPHA, timeout=60
            ) as stream,
        ):
            assert stream.status_code == 200
            for chunk in stream.iter_raw():
                got.append(chunk)
                if len(got) == 1:
                    relay.cut()
        assert got and b"[DONE]" not in b"".join(got)  # the client knows it was cut short
        assert generations(a1) == before  # no second replica ran it
        assert (
            sum(
                gw.counter("ember_gateway_retries", model="alpha", cause=c)
                for c in ("connect", "reset", "timeout", "429", "503")
            )
            == 0
        )
    finally:
        gw.stop()
        relay.close()


def _active(server: LiveServer) -> int:
    state = httpx.get(f"{server.url}/admin/state", headers=ALPHA).json()
    return int(state["activeSequences"]) + int(state["queueDepth"])


def _wait_idle(server: LiveServer, within: float) -> float:
    start = time.monotonic()
    what = f"{server.url} to stop generating after the client left"
    wait_for(what, lambda: _active(server), within, 0.05, until=lambda active: active == 0)
    return time.monotonic() - start


def test_a_client_that_leaves_cancels_the_upstream(
    gateway: Gateway, replicas: list[LiveServer]
) -> None:
    by_host = {host(r): r for r in replicas[:2]}
    body = {
        "model": "alpha",
        "prompt": "Write a long story:",
        "max_tokens": 450,
        "ignore_eos": True,  # it must still be generating when the client leaves
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json=body, headers=ALPHA, timeout=60
    ) as stream:
        replica = by_host[served_by(stream)]
        chunks = stream.iter_raw()  # held: a dropped generator would close the stream
        next(chunks)
        assert _active(replica) == 1
    _wait_idle(replica, within=3.0)  # 450 tokens would take far longer
    # not streaming: the client gives up while the replica generates
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway.url}/v1/completions",
            json={**body, "stream": False},
            headers=ALPHA,
            timeout=httpx.Timeout(60, read=1.0),
        )
    for server in by_host.values():
        _wait_idle(server, within=3.0)
    assert all(r.inflight == 0 for r in gateway.fleet.replicas("alpha"))


def test_streams_pass_through_as_they_are_generated(gateway: Gateway) -> None:
    body = {"model": "alpha", "prompt": "List the planets:", "max_tokens": 60, "stream": True}
    arrivals: list[float] = []
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json=body, headers=ALPHA, timeout=60
    ) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for _ in stream.iter_raw():
            arrivals.append(time.monotonic())
    assert len(arrivals) >= 10  # chunk by chunk, not one buffered body
    assert arrivals[-1] - arrivals[0] > 0.2


def test_a_replica_that_stops_answering_is_out_within_2s_and_back(
    replicas: list[LiveServer], tmp_path: Path
) -> None:
    a1 = replicas[1]
    gone = start_replica(tmp_path / "g", "alpha", ALPHA_KEY)
    port = int(gone.url.rsplit(":", 1)[1])
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, gone.url, a1.url)}, interval=0.4)
    back: LiveServer | None = None
    try:
        gone.stop()
        start = time.monotonic()
        gw.wait_probed(lambda f: not f.replicas("alpha")[0].healthy, timeout=5)
        assert time.monotonic() - start <= 2.0
        assert all(served_by(complete(gw, f"q{i}")) == host(a1) for i in range(3))
        back = start_replica(tmp_path / "g2", "alpha", ALPHA_KEY, listen=port)
        gw.wait_probed(lambda f: f.replicas("alpha")[0].healthy, timeout=5)
    finally:
        gw.stop()
        if back is not None:
            back.stop()


def test_health_readiness_and_metrics(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.url}/healthz").text == "ok"
    assert httpx.get(f"{gateway.url}/readyz").status_code == 200
    complete(gateway, "Hello")
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'ember_gateway_requests_total{code="200",model="alpha"}' in text
    assert 'ember_gateway_healthy_replicas{model="alpha"} 2.0' in text
    assert "ember_gateway_added_seconds_count" in text
    empty = start_gateway({"alpha": route("alpha", None)})
    try:  # nothing to route to: not ready, and a request is a 503 in OpenAI's shape
        assert httpx.get(f"{empty.url}/readyz").status_code == 503
        reply = httpx.post(f"{empty.url}/v1/completions", json={"model": "alpha", "prompt": "x"})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_replica"
    finally:
        empty.stop()


def test_ready_with_no_model_once_discovered_and_not_before() -> None:
    """`helm install --wait --set gateway.enabled=true` before the site's first
    InferenceDeployment: the gateway has nothing to route and must be Ready (else the install
    times out), but only once discovery has answered (until then it does not know)."""
    none = start_gateway({})
    fleet = Fleet(POLICY)

    async def never(fleet: Fleet, metrics: GatewayMetrics) -> None:
        await asyncio.Event().wait()  # an API server that never answers

    blind = start_live(create_app(fleet, never, read_timeout=60.0))
    try:
        assert httpx.get(f"{none.url}/readyz").status_code == 200
        reply = httpx.post(f"{none.url}/v1/completions", json={"model": "alpha", "prompt": "x"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        assert httpx.get(f"{blind.url}/readyz").status_code == 503
    finally:
        none.stop()
        blind.stop()


def test_a_replica_heated_through_its_sensor_is_avoided_within_2s(
    replicas: list[LiveServer], tmp_path: Path
) -> None:
    """The real sensor path: a sysfs thermal zone heats, the replica's governor throttles it,
    and the gateway's probes see that over the LAN (no API server involved)."""
    a1 = replicas[1]
    hot = start_replica(tmp_path / "h", "alpha", ALPHA_KEY, min_batch=1)
    gw = start_gateway({"alpha": route("alpha", ALPHA_KEY, hot.url, a1.url)}, interval=0.4)
    try:
        prompts = [prompt_preferring([hot.url, a1.url], hot.url, tail=f"#{i}") for i in range(4)]
        assert served_by(complete(gw, prompts[0])) == host(hot)  # cool: its prefixes go there
        zone = tmp_path / "h" / "sysfs" / "class" / "thermal" / "thermal_zone0" / "temp"
        zone.write_text("88000\n")
        heated = time.monotonic()
        gw.wait_probed(lambda f: f.replicas("alpha")[0].view().throttled, timeout=10)
        assert time.monotonic() - heated <= 2.0
        assert all(served_by(complete(gw, p)) == host(a1) for p in prompts)
    finally:
        gw.stop()
        hot.stop()
