"""The poller against a REAL runtime process (real engine, real model, real HTTP) whose sensor
reads a fake thermal tree: heat it, see the batch shrink within 2 s; cool it, see hysteresis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from ember_operator.thermal.policy import ThermalLimits
from ember_operator.thermal.poller import Observation, Replica, ReplicaPoller, replicas_from_pods

from tests.thermal.conftest import API_KEY, FakeThermalTree
from tests.thermal.runtime_proc import RuntimeProcess, free_port

ISSUE = ThermalLimits(max_batch=16, min_batch=4, throttle_celsius=78, celsius_per_step=2)
PERIOD = 1.0  # the operator's poll period


@pytest.fixture
async def poller() -> AsyncIterator[ReplicaPoller]:
    async with ReplicaPoller(concurrency=4) as p:
        yield p


class Loop:
    """What the operator's timer does: poll every PERIOD seconds, remember what it saw."""

    def __init__(self, poller: ReplicaPoller, replicas: list[Replica]) -> None:
        self.poller, self.replicas = poller, replicas
        self.seen: list[tuple[float, Observation]] = []

    async def run(self) -> None:
        while True:
            for obs in await self.poller.poll(self.replicas, ISSUE):
                self.seen.append((time.monotonic(), obs))
            await asyncio.sleep(PERIOD)

    async def until(self, batch: int, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if any(t >= start and o.max_batch_size == batch for t, o in self.seen):
                return time.monotonic() - start
            await asyncio.sleep(0.02)
        raise AssertionError(f"batch {batch} not reached in {timeout}s: {self.seen[-5:]}")


def admin_batch(proc: RuntimeProcess) -> int:
    state = httpx.get(f"{proc.url}/admin/state", headers={"Authorization": f"Bearer {API_KEY}"})
    state.raise_for_status()
    return int(state.json()["maxBatchSize"])


async def test_heat_shrinks_within_2s_and_hysteresis_restores(
    runtime: tuple[RuntimeProcess, FakeThermalTree], poller: ReplicaPoller
) -> None:
    proc, tree = runtime
    loop = Loop(poller, [Replica("r0", "node-a", proc.url, API_KEY)])
    task = asyncio.create_task(loop.run())
    try:
        await loop.until(16, timeout=5)
        tree.set(0, 84.0)
        heated = time.monotonic()
        await loop.until(13, timeout=2.0)
        assert admin_batch(proc) == 13, "the runtime itself must run with the new batch"
        reaction = time.monotonic() - heated
        assert reaction <= 2.0, f"took {reaction:.2f}s"
        # Cool to 76 °C: below throttle but inside the hysteresis band → never 16.
        tree.set(0, 76.0)
        await asyncio.sleep(4 * PERIOD)
        band = [o.max_batch_size for t, o in loop.seen if t > heated + 2.5]
        assert band and 16 not in band and band[-1] == 15, band
        assert admin_batch(proc) == 15
        # Below throttle − hysteresis (75): full batch again.
        tree.set(0, 74.0)
        await loop.until(16, timeout=3 * PERIOD + 1)
        assert admin_batch(proc) == 16
        temps = [o.temperature_celsius for _, o in loop.seen]
        assert 84.0 in temps and all(o.error is None for _, o in loop.seen)
    finally:
        task.cancel()
        tree.set(0, 60.0)


async def test_errors_are_reported_per_replica(
    runtime: tuple[RuntimeProcess, FakeThermalTree], poller: ReplicaPoller
) -> None:
    proc, tree = runtime
    tree.set(0, 60.0)
    await asyncio.sleep(0.6)  # the runtime samples every 0.2 s
    replicas = [
        Replica("ok", "n1", proc.url, API_KEY),
        Replica("no-key", "n1", proc.url, None),
        Replica("down", "n2", f"http://127.0.0.1:{free_port()}", API_KEY),
    ]
    by_pod = {o.pod: o for o in await poller.poll(replicas, ISSUE)}
    assert by_pod["ok"].error is None and by_pod["ok"].temperature_celsius == 70.0
    assert by_pod["ok"].as_status() == {"temperatureCelsius": 70, "maxBatchSize": 16}
    assert "HTTP 401" in (by_pod["no-key"].error or "")
    assert by_pod["down"].error and by_pod["down"].max_batch_size is None
    assert by_pod["down"].as_status() == {}


def test_replicas_from_pods() -> None:
    def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, object]:
        meta: dict[str, object] = {"name": name}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {
            "metadata": meta,
            "spec": {"nodeName": "n1"},
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    pods = [
        pod("b", "10.0.0.2", True),
        pod("a", "fd00::1", True),
        pod("c", None, True),
        pod("d", "10.0.0.4", False),
        pod("e", "10.0.0.5", True, deleting=True),
    ]
    got = replicas_from_pods(pods, 8080, api_key="k")
    assert [(r.pod, r.url, r.node) for r in got] == [
        ("a", "http://[fd00::1]:8080", "n1"),
        ("b", "http://10.0.0.2:8080", "n1"),
    ]
    assert all(r.api_key == "k" for r in got)


def test_runtime_process_is_real(runtime: tuple[RuntimeProcess, FakeThermalTree]) -> None:
    proc, _ = runtime
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{proc.url}/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert Path(proc.log).exists()
