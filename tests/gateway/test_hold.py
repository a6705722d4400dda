"""Requests held by the real gateway for a scaled model with no replica, released to a real
runtime (the real engine on the real model) once it answers its probes; refused with 503 and
Retry-After past the queue bound or the timeout; dropped from the queue when the client goes.
The replica "appears" as discovery makes it appear: new routes handed to the fleet."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from ember_runtime.contract.resource import ScalingView
from ember_runtime.gateway.app import Gateway as GatewayApp
from ember_runtime.gateway.app import Scaling, create_app
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.hold import RETRY_AFTER_SECONDS
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.routes import ModelRoute

from tests.gateway.conftest import POLICY, route, start_replica
from tests.runtime.conftest import LiveServer, start_live
from tests.support.net import free_port
from tests.support.waiting import wait_for

ZETA_KEY = "zeta-key-0123456789"
AUTH = {"Authorization": f"Bearer {ZETA_KEY}"}
BODY = {"model": "zeta", "prompt": "The sky is", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def zeta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One replica with a queue long enough for 20 requests at once (4 run, 16 wait)."""
    server = start_replica(tmp_path_factory.mktemp("zeta"), "zeta", ZETA_KEY, maxQueue=32)
    yield server
    server.stop()


def at_zero(*backends: str) -> ModelRoute:
    """zeta, scaled by the gateway; no replica unless given one."""
    return dataclasses.replace(route("zeta", ZETA_KEY, *backends), scaling=ScalingView())


class HeldSite:
    """The real gateway app on a real socket; `publish` hands the fleet new routes on the
    gateway's own loop, as a watch event would."""

    def __init__(self, routes: dict[str, ModelRoute], max_requests: int, timeout: float) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fleet = Fleet(POLICY, interval=0.1, timeout=0.5)

        async def discover(fleet: Fleet, metrics: GatewayMetrics) -> None:
            self.loop = asyncio.get_running_loop()
            fleet.update(routes)

        scaling = Scaling(hold_max_requests=max_requests, hold_timeout=timeout)
        app = create_app(self.fleet, discover, read_timeout=60.0, scaling=scaling)
        self.live = start_live(app)
        self.app: GatewayApp = app.state.gateway
        wait_for("discovery to run", lambda: self.loop is not None and self.fleet.routes, 10)
        self.pool = ThreadPoolExecutor(32)

    def publish(self, routes: dict[str, ModelRoute]) -> None:
        async def update() -> None:
            self.fleet.update(routes)

        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(update(), self.loop).result(5)

    def send(self, timeout: float = 120.0, **body: object) -> Future[httpx.Response]:
        url = f"{self.live.url}/v1/completions"
        return self.pool.submit(
            httpx.post, url, json={**BODY, **body}, headers=AUTH, timeout=timeout
        )

    def held(self, model: str = "zeta") -> int:
        return self.app.holds.held(model)

    def gauge(self, model: str = "zeta") -> float:
        value = self.app.metrics.registry.get_sample_value(
            "ember_gateway_held_requests", {"model": model}
        )
        return value or 0.0

    def wait_held(self, count: int, timeout: float = 10.0) -> None:
        wait_for(f"{count} requests held", lambda: self.held() == count, timeout, 0.02)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.live.stop()


@pytest.fixture
def site(request: pytest.FixtureRequest) -> Iterator[HeldSite]:
    bounds = getattr(request, "param", (64, 120.0))
    held = HeldSite({"zeta": at_zero()}, *bounds)
    yield held
    held.stop()


def assert_unavailable(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
    error = response.json()["error"]  # OpenAI's shape
    assert error["code"] == code and error["type"] and error["message"]


def test_a_held_request_is_released_when_a_replica_answers(
    site: HeldSite, zeta: LiveServer
) -> None:
    pending = site.send()
    site.wait_held(1)
    assert site.gauge() == 1
    assert not pending.done()  # held, not refused
    site.publish({"zeta": at_zero(zeta.url)})  # its pod is Ready: the probe lets it in
    response = pending.result(60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert site.held() == 0 and site.gauge() == 0


def test_twenty_held_requests_all_succeed_once_a_replica_appears(
    site: HeldSite, zeta: LiveServer
) -> None:
    pending = [site.send(prompt=f"Count to {i}:") for i in range(20)]
    site.wait_held(20)
    site.publish({"zeta": at_zero(zeta.url)})
    codes = [f.result(120).status_code for f in pending]
    assert codes == [200] * 20


@pytest.mark.parametrize("site", [(2, 120.0)], indirect=True)
def test_past_the_queue_bound_a_503_with_retry_after(site: HeldSite, zeta: LiveServer) -> None:
    held = [site.send(), site.send()]
    site.wait_held(2)
    refused = site.send().result(10)  # the third: at once, not after the timeout
    assert_unavailable(refused, "hold_queue_full")
    site.publish({"zeta": at_zero(zeta.url)})
    assert [f.result(60).status_code for f in held] == [200, 200]  # nothing else lost


@pytest.mark.parametrize("site", [(64, 0.5)], indirect=True)
def test_past_the_timeout_a_503_with_retry_after(site: HeldSite) -> None:
    response = site.send().result(10)
    assert_unavailable(response, "hold_timeout")
    assert site.held() == 0 and site.gauge() == 0


def test_a_client_that_goes_away_leaves_the_queue(site: HeldSite) -> None:
    gone = site.send(timeout=0.5)  # the client gives up after half a second and closes
    with pytest.raises(httpx.TimeoutException):
        gone.result(10)
    wait_for("the queue to drop it", lambda: site.held() == 0, 5, 0.02)  # hold timeout: 120 s
    assert site.gauge() == 0


def test_models_without_scaling_are_not_held_and_every_name_is_listed(zeta: LiveServer) -> None:
    plain = route("plain", None)  # no scaling, no replica: today's answer at once
    lora = dataclasses.replace(at_zero(), name="zeta-lora")  # an adapter of zeta
    site = HeldSite({"zeta": at_zero(), "zeta-lora": lora, "plain": plain}, 64, 120.0)
    try:
        body = {**BODY, "model": "plain"}
        got = httpx.post(f"{site.live.url}/v1/completions", json=body, timeout=10)
        assert got.status_code == 503 and got.json()["error"]["code"] == "no_replica"
        assert "retry-after" not in got.headers and site.held("plain") == 0
        listed = httpx.get(f"{site.live.url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["plain", "zeta", "zeta-lora"]  # at zero, listed
        held = site.send(model="zeta-lora")  # an adapter of a model at zero is held too
        wait_for("the adapter's request held", lambda: site.held("zeta-lora") == 1, 10, 0.02)
        assert not held.done()
        site.publish({"zeta": at_zero(zeta.url), "zeta-lora": dataclasses.replace(
            at_zero(zeta.url), name="zeta-lora")})  # fmt: skip
        # released to the base's replica (whose answer for an adapter is the runtime's concern)
        assert held.result(60).headers["x-ember-replica"] == zeta.url.rpartition("/")[2]
    finally:
        site.stop()


def test_a_wrong_key_is_refused_before_any_hold(site: HeldSite) -> None:
    got = httpx.post(f"{site.live.url}/v1/completions", json=BODY, timeout=10)
    assert got.status_code == 401 and site.held() == 0


def test_a_replica_gone_before_the_forward_holds_the_request_again(
    site: HeldSite, zeta: LiveServer
) -> None:
    """Its only replica went between its last probe and this request (a restart, a scale-down
    racing a new request): the request is held again, not answered with a 503."""
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens: the connection is refused
    site.publish({"zeta": at_zero(gone)})
    (replica,) = site.fleet.replicas("zeta")
    site.fleet.interval = 30.0  # no probe will notice it first (after the one under way)
    time.sleep(0.5)

    async def believe() -> None:
        replica.healthy = True

    assert site.loop is not None
    asyncio.run_coroutine_threadsafe(believe(), site.loop).result(5)
    pending = site.send()
    site.wait_held(1)  # refused on connect: marked down, and held again
    site.publish({"zeta": at_zero(zeta.url)})
    response = pending.result(60)
    assert response.status_code == 200, response.text
