"""The scaler's decisions (pure: wanted replicas, stabilization, the swap victim) and its passes
over a fleet, writing through a recording writer in place of the scale subresource (the PATCH
itself meets the real API server in test_scaler_cluster.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ember_runtime.contract.resource import ScalingView
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.hold import Holds
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.policy import Policy
from ember_runtime.gateway.routes import Backend, ModelRoute
from ember_runtime.gateway.scaler import (
    RETRY_SECONDS,
    Load,
    Scaler,
    Window,
    decide,
    victim,
    wanted,
)
from ember_runtime.kube import ApiError


def load(replicas: int = 0, in_flight: int = 0, held: int = 0, **kw: Any) -> Load:
    scaling = ScalingView(
        min_replicas=kw.pop("min", 0),
        max_replicas=kw.pop("max", 4),
        idle_seconds=kw.pop("idle", 60),
        priority=kw.pop("priority", 0),
    )
    owner = kw.pop("owner", "ns/m")
    return Load(owner, scaling, replicas, kw.pop("target", 4), in_flight, held, **kw)


@pytest.mark.parametrize(
    ("demand", "bounds", "want"),
    [
        (0, (0, 4), 0),  # idle: to zero
        (1, (0, 4), 1),  # one request wakes a model at zero
        (4, (0, 4), 1),  # a replica takes targetInFlight
        (5, (0, 4), 2),
        (100, (0, 4), 4),  # never above maxReplicas
        (0, (2, 4), 2),  # never below minReplicas
    ],
)
def test_wanted_replicas(demand: int, bounds: tuple[int, int], want: int) -> None:
    low, high = bounds
    assert wanted(load(held=demand, min=low, max=high)) == want
    assert wanted(load(in_flight=demand, min=low, max=high)) == want


def test_up_at_once_down_only_after_idle_seconds() -> None:
    window = Window()
    assert decide(load(replicas=0, held=1), window, now=0.0) == 1  # at once
    assert decide(load(replicas=1, held=9), window, now=0.1) == 3
    busy = load(replicas=3, in_flight=9)
    assert decide(busy, window, now=1.0) == 3
    quiet = dataclasses.replace(busy, in_flight=0)
    assert decide(quiet, window, now=2.0) == 3  # the window starts
    assert decide(quiet, window, now=61.9) == 3  # not yet idleSeconds
    assert decide(quiet, window, now=62.0) == 0  # idle for 60 s: down
    assert window.since is None


def test_a_busy_moment_in_the_window_restarts_it_and_the_peak_is_kept() -> None:
    window = Window()
    quiet, some = load(replicas=3), load(replicas=3, in_flight=5)
    assert decide(quiet, window, now=0.0) == 3
    assert decide(some, window, now=30.0) == 3  # wants 2: still in the window, peak 2
    assert decide(quiet, window, now=61.0) == 2  # down to the most it wanted in the window
    again = Window()
    assert decide(quiet, again, now=0.0) == 3
    assert decide(load(replicas=3, in_flight=12), again, now=30.0) == 3  # wants 3: reset
    assert decide(quiet, again, now=61.0) == 3  # the window began again at 61
    assert decide(quiet, again, now=120.0) == 3
    assert decide(quiet, again, now=121.0) == 0


def test_never_down_below_what_the_demand_needs() -> None:
    window = Window()
    assert decide(load(replicas=4, in_flight=6), window, now=0.0) == 4
    assert decide(load(replicas=4, in_flight=6), window, now=100.0) == 2  # 6 need 2 of 4 each
    little = load(replicas=2, in_flight=1, held=1)
    assert decide(little, window, now=500.0) == 2  # a new window
    assert decide(little, window, now=560.0) == 1  # idle long enough, yet 2 requests need one


def test_the_victim_is_the_lowest_priority_then_least_recently_used() -> None:
    waiting = load(owner="ns/w", held=1, unschedulable=True, priority=5)
    idle = {"ready": 1, "replicas": 1}
    old = load(owner="ns/old", last_used=10.0, priority=1, **idle)
    new = load(owner="ns/new", last_used=20.0, priority=1, **idle)
    low = load(owner="ns/low", last_used=30.0, priority=0, **idle)
    assert victim(waiting, [waiting, old, new, low]) == low  # priority before recency
    assert victim(waiting, [waiting, new, old]) == old  # then least recently used
    never = load(owner="ns/never", last_used=0.0, priority=1, **idle)
    assert victim(waiting, [old, never]) == never  # never used here: the least recent


@pytest.mark.parametrize(
    "why",
    ["in_flight", "held", "at_min", "higher_priority", "not_ready", "itself"],
)
def test_who_is_never_a_victim(why: str) -> None:
    waiting = load(owner="ns/w", held=1, unschedulable=True, priority=1)
    other = load(owner="ns/o", ready=1, replicas=1, priority=1)
    spoiled = {
        "in_flight": dataclasses.replace(other, in_flight=1),  # a busy model, ever
        "held": dataclasses.replace(other, held=1),
        "at_min": load(owner="ns/o", ready=1, replicas=1, min=1, priority=1),
        "higher_priority": load(owner="ns/o", ready=1, replicas=1, priority=2),
        "not_ready": dataclasses.replace(other, ready=0),  # nothing there to free yet
        "itself": dataclasses.replace(waiting, ready=1, replicas=1, held=0),
    }[why]
    assert victim(waiting, [other]) == other  # the unspoiled one is
    assert victim(waiting, [spoiled]) is None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scaled_route(name: str, replicas: int, *backends: str, **scaling: Any) -> ModelRoute:
    return ModelRoute(
        name,
        f"ns/{name}",
        None,
        tuple(Backend(b, f"http://{b}") for b in backends),
        scaling=ScalingView.model_validate(scaling),
        replicas=replicas,
        target_in_flight=2,
    )


class Site:
    """A fleet of routes, its holds and a scaler writing into `writes` (or raising `fail`)."""

    def __init__(self, *routes: ModelRoute) -> None:
        self.fleet, self.metrics, self.clock = Fleet(Policy()), GatewayMetrics(), Clock()
        self.fleet.update({r.name: r for r in routes})
        self.holds = Holds(self.fleet, self.metrics)
        self.writes: list[tuple[str, int]] = []
        self.fail: Exception | None = None
        self.scaler = Scaler(
            self.fleet, self.holds, self.metrics, self.write, swap_interval=30.0, clock=self.clock
        )

    async def write(self, owner: str, replicas: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.writes.append((owner, replicas))

    def step(self) -> list[tuple[str, int]]:
        self.writes.clear()
        asyncio.run(self.scaler.step())
        return list(self.writes)

    def ready(self, model: str, **state: int) -> None:
        for replica in self.fleet.replicas(model):
            replica.healthy = True
            for key, value in state.items():
                setattr(replica, key, value)

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_held_request_wakes_a_model_at_zero_written_once() -> None:
    site = Site(scaled_route("zeta", 0), scaled_route("plain-ish", 0))
    assert site.step() == []  # no demand, nothing written
    site.holds.waiting["zeta"] = 3
    assert site.step() == [("ns/zeta", 1)]  # max 1 (the default)
    assert site.step() == []  # written: not again while the watch catches up
    site.fleet.update({"zeta": scaled_route("zeta", 1)})  # the watch brings spec.replicas back
    assert site.step() == []
    assert site.metric("ember_gateway_scale_writes_total", deployment="ns/zeta", direction="up")


def test_in_flight_counts_the_replicas_reports_and_adapters_share_their_base() -> None:
    base = scaled_route("base", 1, "pod-0", maxReplicas=3, idleSeconds=5)
    site = Site(base, dataclasses.replace(base, name="base-lora"))
    site.ready("base", active=3, queued=1)  # e.g. another gateway's requests
    site.holds.waiting["base-lora"] = 1
    assert site.step() == [("ns/base", 3)]  # (4 + 1) / 2 per replica → 3, one owner
    assert site.fleet.replicas("base-lora") == site.fleet.replicas("base")  # one pod, one state


def test_down_after_idle_seconds_on_the_clock() -> None:
    site = Site(scaled_route("zeta", 1, "pod-0", idleSeconds=60))
    site.ready("zeta", inflight=1)
    assert site.step() == []
    site.ready("zeta", inflight=0)
    assert site.step() == []  # the window starts
    site.clock.now += 59
    assert site.step() == []
    site.clock.now += 1
    assert site.step() == [("ns/zeta", 0)]


def test_a_model_that_does_not_fit_swaps_out_one_idle_victim_at_a_time() -> None:
    waiting = dataclasses.replace(
        scaled_route("big", 1, priority=1), unschedulable=True
    )  # its pod is Pending: Unschedulable
    busy = dataclasses.replace(scaled_route("busy", 1, "b-0", idleSeconds=999), pods=1)
    idle_old = dataclasses.replace(scaled_route("old", 2, "o-0", "o-1", idleSeconds=999), pods=2)
    idle_new = dataclasses.replace(scaled_route("new", 1, "n-0", idleSeconds=999), pods=1)
    site = Site(waiting, busy, idle_old, idle_new)
    site.ready("busy", inflight=1)
    site.ready("old")
    site.ready("new")
    site.scaler.last_used.update({"ns/old": 1.0, "ns/new": 2.0, "ns/busy": 0.5})
    assert site.step() == []  # nothing held for it: no swap
    site.holds.waiting["big"] = 1
    assert site.step() == [("ns/old", 1)]  # least recently used idle one, one replica
    assert site.metric("ember_gateway_swaps_total", deployment="ns/old") == 1
    assert site.step() == []  # one victim until its pod has gone
    going = dataclasses.replace(idle_old, replicas=1, pods=2)  # spec.replicas 1, a pod leaving
    site.fleet.update({**site.fleet.routes, "old": going})
    site.clock.now += 29
    assert site.step() == []  # its pod still there: its memory is not free yet
    site.fleet.update({**site.fleet.routes, "old": dataclasses.replace(going, pods=1)})
    assert site.step() == []  # gone: the scheduler's turn to place the waiting pod
    site.clock.now += 2
    assert site.step() == [("ns/old", 0)]  # still pending: the next one
    stuck = dataclasses.replace(going, replicas=0, pods=1)  # its pod never goes
    site.fleet.update({**site.fleet.routes, "old": stuck})
    site.clock.now += 29
    assert site.step() == []
    site.clock.now += 1  # swap_interval: given up on; the scheduler's turn, then another
    assert site.step() == []
    site.clock.now += 2
    assert site.step() == [("ns/new", 0)]
    scheduled = dataclasses.replace(waiting, unschedulable=False)
    site.fleet.update({**site.fleet.routes, "big": scheduled})
    assert site.step() == []  # scheduled: no more swaps


def test_a_failed_write_is_retried_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    site = Site(scaled_route("zeta", 0))
    site.holds.waiting["zeta"] = 1
    site.fail = ApiError(403, "forbidden")
    assert site.step() == []
    assert "scaling ns/zeta to 1" in caplog.text
    site.fail = None
    assert site.step() == []  # not before RETRY_SECONDS
    site.clock.now += RETRY_SECONDS
    assert site.step() == [("ns/zeta", 1)]


def test_models_without_scaling_are_left_alone() -> None:
    plain = ModelRoute("plain", "ns/plain", None, (), replicas=0)
    site = Site(plain)
    site.holds.waiting["plain"] = 5  # cannot happen (never held), and still not scaled
    assert site.step() == []


def test_the_ollama_order_is_keep_alive_then_name_with_no_priorities() -> None:
    """The benchmark's baseline: Ollama's findRunnerToUnload (shortest keep-alive, then name),
    which neither protects a higher priority nor looks at recency."""
    waiting = load(owner="ns/waiting", held=1, unschedulable=True)
    idle = {"ready": 1, "replicas": 1}
    shielded = load(owner="ns/a-first", priority=5, last_used=9.0, **idle)
    recent = load(owner="ns/b-second", last_used=8.0, **idle)
    short = load(owner="ns/c-short", last_used=9.5, idle=30, **idle)
    assert victim(waiting, [shielded, recent], "ollama") == shielded
    assert victim(waiting, [shielded, recent]) == recent  # Ember's: priority, then LRU
    assert victim(waiting, [shielded, recent, short], "ollama") == short
