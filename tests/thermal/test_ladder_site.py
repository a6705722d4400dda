"""The thermal ladder keeps a device that heats with its own work from tripping; without it the
same device, the same enclosure and the same load trip it.

Two replicas (real engine, real model) behind the site gateway, each on its own thermal plant
(tests/thermal/plant.py): power follows the CPU time each really consumes. Replica 0 is an NPU
in a hot enclosure whose firmware has no passive trip, only a shutdown one (the RK3588's NPU
zone in the mainline device tree): busy, it settles past that trip. Replica 1 is in the open.
Four back-to-back clients go through the gateway.

- `adaptive`: the governor steps the batch down, then at critical the replica sheds: the
  gateway sends its new work to the peer, the device cools, and it never trips.
- `static`: the same everything with `thermal.policy: static`: the device trips (its process is
  killed and comes back), which is what makes this test able to fail.

Needs root (a cgroup v1 CPU quota per replica).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from ember_runtime.contract.thermal import ThermalPolicy

from bench.gateway_overhead import start
from tests.support.net import free_port
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.plant import CGROUP_CPU, CpuQuota, Plant, PlantedRuntime, Profile
from tests.thermal.runtime_proc import start_runtime

pytestmark = pytest.mark.skipif(
    not (CGROUP_CPU / "cgroup.procs").exists(), reason="needs cgroup v1 cpu (root)"
)

# No passive trip (throttle above the trip): only the shutdown at 115 °C. Busy in a 50 °C
# enclosure it settles at 50 + 6 × 12 = 122 °C; idle at 62 °C. τ = 180 s emulated.
NPU = Profile("npu-shutdown-only", 2.0, 12.0, 6.0, 30.0, 200.0, 115.0, reset_seconds=60.0)
SPEED = 20.0  # τ is 9 s real
MODEL = "gemma3-270m"  # tests/thermal/runtime_proc.py's served name
EMULATED = 800.0  # seconds: past the static arm's trip (about 420 s) with room to spare
POLICY = ThermalPolicy(min_batch_size=2, throttle_celsius=85, critical_celsius=100)


def box(
    work: Path, tree: FakeThermalTree, policy: ThermalPolicy, quota: CpuQuota
) -> PlantedRuntime:
    """One replica on its device, reading the device's sensor tree."""
    return PlantedRuntime(
        quota,
        lambda port: start_runtime(
            work, tree.root, max_batch=8, min_batch=2, interval=0.25, thermal=policy, port=port
        ),
    )


def constant(air: float) -> Callable[[float], float]:
    return lambda _emulated: air


@contextmanager
def site(tmp_path: Path, adaptive: bool) -> Iterator[tuple[list[Plant], str]]:
    policy = POLICY.model_copy(update={"adaptive": adaptive})
    with ExitStack() as stack:
        runtimes, plants = [], []
        for i, air in enumerate((50.0, 25.0)):
            quota = CpuQuota(f"site-test-{i}", 0.5)
            stack.callback(quota.close)
            work = tmp_path / f"r{i}"
            work.mkdir()
            tree = FakeThermalTree(work / "sys")
            tree.zone(0, "npu-thermal", air)
            runtime = box(work, tree, policy, quota)
            stack.callback(runtime.stop)
            plant = Plant(NPU, runtime.device(), tree, speed=SPEED, ambient=constant(air))
            stack.callback(plant.stop)
            runtimes.append(runtime)
            plants.append(plant)
        routes = tmp_path / "routes.json"
        replicas = [r.url for r in runtimes]
        routes.write_text(json.dumps({"models": [{"name": MODEL, "replicas": replicas}]}))
        port = free_port()
        argv = [sys.executable, "-m", "ember_runtime.gateway", "--static", str(routes)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        gateway = start(argv, f"http://127.0.0.1:{port}/readyz", tmp_path / "gateway.log")
        stack.callback(gateway.wait, 30)
        stack.callback(gateway.terminate)
        for plant in plants:
            plant.start()
        yield plants, f"http://127.0.0.1:{port}"


async def load(url: str, seconds: float) -> int:
    """Four back-to-back streaming clients through the gateway; completed requests."""
    done = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def client() -> None:
        nonlocal done
        body = {
            "model": MODEL,
            "prompt": "Describe a heat sink.",
            "max_tokens": 24,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while loop.time() < deadline:
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                        done += resp.status_code == 200
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)

    await asyncio.gather(*(client() for _ in range(4)))
    return done


@pytest.mark.parametrize("adaptive", [True, False], ids=["ladder", "static"])
def test_the_ladder_keeps_the_hot_device_from_tripping(tmp_path: Path, adaptive: bool) -> None:
    with site(tmp_path, adaptive) as (plants, url):
        done = asyncio.run(load(url, EMULATED / SPEED))
    hot, cool = plants
    assert done > 0
    assert cool.state.trips == 0
    if adaptive:
        assert hot.state.trips == 0, f"tripped at {max(c for _, c, *_ in hot.log):.1f} °C"
        assert max(c for _, c, *_ in hot.log) < NPU.trip_celsius - 5
    else:
        assert hot.state.trips >= 1, f"peak {max(c for _, c, *_ in hot.log):.1f} °C, no trip"
