"""Replicas that follow the gateway's view of demand, from zero, and models swapped by memory
(issue 47).

Why the gateway's own loop and not an HPA: the demand that matters (requests in flight and
requests held for a model at zero) is known here first and exactly; an HPA would need it
exported through a metrics server and a custom/external metrics adapter, which a small edge
cluster does not run and the chart does not bring, and an HPA cannot scale from or to zero
without the alpha HPAScaleToZero feature gate. The loop writes `spec.replicas` through the
InferenceDeployment's scale subresource (RBAC: `get`, `patch` on `inferencedeployments/scale`,
nothing else); the operator clamps it into [minReplicas, maxReplicas] when it renders the
Deployment.

Per scaled InferenceDeployment (its base model and adapters together):
    demand  = in flight (the most of this gateway's count and what the replicas report, which
              covers a second gateway's requests) + requests held here
    wanted  = clamp(ceil(demand / targetInFlight), minReplicas, maxReplicas), at least 1 while
              demand > 0 (a model at zero wakes)
Up: at once. Down: only once `wanted` has stayed below the current count for idleSeconds, and
then to the most it wanted in that window, so the count never drops below what the current
demand needs (the runtimes drain their streams on SIGTERM anyway). No flapping: one busy moment
in the window keeps the replicas.

Swapping: pods are sized with requests == limits (the operator), so it is the scheduler, not an
OOM kill, that says a model does not fit: its pod stays Pending, PodScheduled=False reason
Unschedulable. When a model with held requests has such a pod, one other scaled model of the
site gives up one replica: among those with ready replicas, nothing in flight, nothing held,
more replicas than their minimum and a priority no higher than the waiting model's, the lowest
priority first, then the least recently used (the last request this gateway saw). A model
with requests in flight is never a victim. One victim at a time: the next is chosen only once
the last one's pod is gone (its memory is free only then) and SETTLE_SECONDS have passed (the
scheduler's retry of the waiting pod), or after `swap_interval` if its pod never goes.

`order="ollama"` is Ollama's own rule instead (server/sched.go `findRunnerToUnload`: the first
idle runner by keep-alive duration, then by model name; no priorities, no recency), kept as the
baseline the density benchmark compares against: the same gateway, only the choice differs.

Several gateways (the chart's `gateway.replicas`, or one per site over one namespace) each run
this loop: scale-ups are idempotent (each writes the count its own demand needs), and a
gateway sees the others' requests only as the replicas report them at each probe, so a short
request between two probes of another gateway's replica may go unseen. One gateway replica per
site gives the exact view; LRU order is per gateway.

Failures (API server away, a 403) are logged and retried after RETRY_SECONDS; the gateway keeps
serving what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from ember_runtime.contract.resource import ScalingView, object_path
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.hold import Holds
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.routes import ModelRoute
from ember_runtime.kube import API_ERRORS, KubeClient

log = logging.getLogger(__name__)
RETRY_SECONDS = 3.0
# After a write, the watch brings the new spec.replicas back; until then (at most this long)
# the count written stands for it, so nothing is written twice or decided on a stale count.
ASKED_SECONDS = 10.0
# After a victim's pod is gone: time for the scheduler to place the waiting pod (a deleted pod
# moves unschedulable ones back to its active queue) before another model is chosen.
SETTLE_SECONDS = 2.0
# (owner "namespace/name", replicas): sets spec.replicas.
Writer = Callable[[str, int], Awaitable[None]]
SwapOrder = Literal["priority-lru", "ollama"]


@dataclass(frozen=True, slots=True)
class Load:
    """One scaled InferenceDeployment as the scaler sees it at one moment."""

    owner: str
    scaling: ScalingView
    replicas: int  # spec.replicas
    target: int  # requests one replica takes
    in_flight: int
    held: int = 0
    ready: int = 0  # Ready pods on this site's nodes
    unschedulable: bool = False
    last_used: float = 0.0  # monotonic; 0: never used through this gateway
    pods: int = 0  # its pods that exist, terminating ones too

    @property
    def demand(self) -> int:
        return self.in_flight + self.held

    @property
    def priority(self) -> int:
        return self.scaling.priority


def wanted(load: Load) -> int:
    s = load.scaling
    need = math.ceil(load.demand / load.target)
    if load.demand > 0:
        need = max(need, 1)  # wake from zero
    return max(s.min_replicas, min(s.max_replicas, need))


@dataclass
class Window:
    """Stabilization: since when `wanted` stayed below the current count, and its peak."""

    since: float | None = None
    peak: int = 0


def decide(load: Load, window: Window, now: float) -> int:
    """The count `load` should have now (its current one: nothing to write); moves `window`."""
    want = wanted(load)
    if want >= load.replicas:
        window.since = None
        return want
    if window.since is None:
        window.since, window.peak = now, want
    window.peak = max(window.peak, want)
    if now - window.since < load.scaling.idle_seconds:
        return load.replicas
    window.since = None
    return window.peak


def victim(waiting: Load, others: Iterable[Load], order: SwapOrder = "priority-lru") -> Load | None:
    """Who gives up one replica so that `waiting`'s pending pod fits (rule: module docstring)."""
    candidates = [
        o
        for o in others
        if o.owner != waiting.owner
        and o.ready > 0
        and o.in_flight == 0
        and o.held == 0
        and o.replicas > o.scaling.min_replicas
        and (order == "ollama" or o.priority <= waiting.priority)
    ]
    if order == "ollama":
        return min(candidates, key=lambda o: (o.scaling.idle_seconds, o.owner), default=None)
    return min(candidates, key=lambda o: (o.priority, o.last_used, o.owner), default=None)


def scale_writer(client: KubeClient) -> Writer:
    """A merge patch of `spec.replicas` to the scale subresource (the gateway's own token)."""

    async def write(owner: str, replicas: int) -> None:
        namespace, _, name = owner.partition("/")
        path = object_path(namespace, name) + "/scale"
        await client.patch(path, {"spec": {"replicas": replicas}})

    return write


class Scaler:
    def __init__(
        self,
        fleet: Fleet,
        holds: Holds,
        metrics: GatewayMetrics,
        writer: Writer | None,
        *,
        interval: float = 1.0,
        swap_interval: float = 30.0,
        order: SwapOrder = "priority-lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.order = order
        self.fleet, self.holds, self.metrics, self.writer = fleet, holds, metrics, writer
        self.interval, self.swap_interval, self.clock = interval, swap_interval, clock
        self.last_used: dict[str, float] = {}  # by owner
        self.windows: dict[str, Window] = {}
        self.asked: dict[str, tuple[int, float]] = {}  # owner → (replicas, when): written
        self.failed_at: dict[str, float] = {}
        self.victim: tuple[str, float] | None = None  # (owner, when): its pod is going
        self.settled_at = -math.inf  # when another victim may be chosen
        self._wake = asyncio.Event()
        holds.wake = self._wake.set

    def used(self, route: ModelRoute) -> None:
        """A request for `route` arrived (the LRU order of swapping)."""
        if route.scaling is not None:
            self.last_used[route.owner] = self.clock()

    def loads(self) -> list[Load]:
        """Every scaled InferenceDeployment, its names' demand summed."""
        by_owner: dict[str, list[ModelRoute]] = {}
        for route in self.fleet.routes.values():
            if route.scaling is not None:
                by_owner.setdefault(route.owner, []).append(route)
        return [self._load(owner, routes) for owner, routes in sorted(by_owner.items())]

    def _replicas(self, route: ModelRoute) -> int:
        """spec.replicas, or what was just written there while the watch catches up."""
        asked = self.asked.get(route.owner)
        if asked is None or asked[0] == route.replicas or self.clock() - asked[1] > ASKED_SECONDS:
            self.asked.pop(route.owner, None)
            return route.replicas
        return asked[0]

    def _load(self, owner: str, routes: list[ModelRoute]) -> Load:
        replicas = self.fleet.of_owner(owner)
        mine = sum(r.inflight for r in replicas)
        reported = sum(r.active + r.queued for r in replicas if r.healthy)
        base = routes[0]
        assert base.scaling is not None  # loads() keeps scaled routes only
        return Load(
            owner,
            base.scaling,
            self._replicas(base),
            base.target_in_flight,
            in_flight=max(mine, reported),
            held=sum(self.holds.held(r.name) for r in routes),
            ready=len(base.backends),  # Ready pods of this site: memory a swap can free
            unschedulable=base.unschedulable,
            last_used=self.last_used.get(owner, 0.0),
            pods=base.pods,
        )

    async def step(self) -> None:
        """One pass: each model's count, then at most one swap."""
        loads, now = self.loads(), self.clock()
        for owner in set(self.windows) - {x.owner for x in loads}:
            del self.windows[owner]
        for load in loads:
            count = decide(load, self.windows.setdefault(load.owner, Window()), now)
            await self._write(load, count, now)
        await self._swap(self.loads(), now)  # read again: with the counts just written

    def _paced(self, loads: list[Load], now: float) -> bool:
        """True while the last victim's memory is not back yet (module docstring)."""
        if self.victim is not None:
            owner, since = self.victim
            last = next((x for x in loads if x.owner == owner), None)
            going = last is not None and last.pods > last.replicas
            if going and now - since < self.swap_interval:
                return True
            self.victim, self.settled_at = None, now + SETTLE_SECONDS
        return now < self.settled_at

    async def _swap(self, loads: list[Load], now: float) -> None:
        if self._paced(loads, now):
            return
        for waiting in (x for x in loads if x.unschedulable and x.held > 0):
            chosen = victim(waiting, loads, self.order)
            if chosen is None:
                continue
            log.info(
                "%s does not fit: %s (priority %d, idle) gives up a replica",
                waiting.owner, chosen.owner, chosen.priority,
            )  # fmt: skip
            if await self._write(chosen, chosen.replicas - 1, now):
                self.metrics.swaps.labels(chosen.owner).inc()
                self.victim = (chosen.owner, now)
            return

    async def _write(self, load: Load, count: int, now: float) -> bool:
        """Writes a change only (`load.replicas` counts what was just written); True if done."""
        if count == load.replicas or self.writer is None:
            return False
        if now - self.failed_at.get(load.owner, -math.inf) < RETRY_SECONDS:
            return False
        try:
            await self.writer(load.owner, count)
        except API_ERRORS as exc:
            log.warning("scaling %s to %d: %s; retrying", load.owner, count, exc)
            self.failed_at[load.owner] = now
            return False
        direction = "up" if count > load.replicas else "down"
        log.info("%s: %d → %d replicas (demand %d)", load.owner, load.replicas, count, load.demand)
        self.metrics.scale_writes.labels(load.owner, direction).inc()
        self.asked[load.owner] = (count, now)
        return True

    async def run(self) -> None:
        """Until cancelled: a pass every `interval`, and at once when a request is held."""
        while True:
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # never the gateway's end: the next pass tries again
                log.exception("the scaler's pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
