"""The replicas' live state, read from the replicas themselves over the site's LAN.

Every `interval` seconds the gateway asks each replica for `GET /admin/state` (its batch limit,
capacity, active and queued sequences, thermal reason, draining: `contract.admin`, read
tolerantly), with that replica's own API key and a `timeout` (polling, not piggy-backing on
responses: an idle or a cooling replica sends no responses, and its recovery must still be
seen). A replica that refuses the connection is out
at once; one that fails two probes in a row is out (within 2 × (interval + timeout)); one that
answers is back. The gateway counts its own requests in flight per replica between probes.

A replica is one pod: a base model and its adapters are routes to the same replicas (keyed by
owner and backend), so the pod is probed once and its in-flight count covers every name it
serves. Requests held for a model with no healthy replica wait on `until_healthy`, which every
replica coming in wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from ember_runtime.contract.admin import STATE_PATH, read_admin_state
from ember_runtime.gateway.policy import Policy, ReplicaView, is_shedding, is_throttled, order
from ember_runtime.gateway.routes import Backend, ModelRoute

log = logging.getLogger(__name__)
FAILURES_TO_EJECT = 2


@dataclass(eq=False)
class Replica:
    backend: Backend
    api_key: str | None
    batch_limit: int = 0
    capacity: int = 0
    active: int = 0
    queued: int = 0
    reason: str = ""
    draining: bool = False
    healthy: bool = False  # until its first probe answers
    failures: int = 0
    inflight: int = 0
    probed_at: float = 0.0

    def view(self) -> ReplicaView:
        return ReplicaView(
            key=self.backend.key,
            batch_limit=self.batch_limit,
            active=self.active,
            queued=self.queued,
            inflight=self.inflight,
            throttled=is_throttled(self.reason, self.batch_limit, self.capacity),
            healthy=self.healthy,
            draining=self.draining,
            shedding=is_shedding(self.reason),
        )

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class Fleet:
    """Routes plus each replica's state; the routes change only through `update`."""

    def __init__(self, policy: Policy, interval: float = 0.4, timeout: float = 0.5) -> None:
        self.policy, self.interval, self.timeout = policy, interval, timeout
        self.routes: dict[str, ModelRoute] = {}
        self._replicas: dict[tuple[str, str], Replica] = {}  # (owner, backend key)
        self._changed = asyncio.Event()
        self._came_in = asyncio.Event()  # replaced after each wake-up: a broadcast
        self.synced = False  # routes given at least once (a discovery list, a snapshot)

    def update(self, routes: Mapping[str, ModelRoute]) -> None:
        """New routes; a replica whose address and key are unchanged keeps its state."""
        fresh: dict[tuple[str, str], Replica] = {}
        for route in routes.values():
            for backend in route.backends:
                at = (route.owner, backend.key)
                old = fresh.get(at) or self._replicas.get(at)
                same = old is not None and old.backend == backend and old.api_key == route.api_key
                fresh[at] = old if same and old else Replica(backend, route.api_key)
        self.routes, self._replicas = dict(routes), fresh
        self.synced = True
        self._changed.set()
        self._wake()  # a static or restored route may come with healthy replicas

    def replicas(self, model: str) -> list[Replica]:
        route = self.routes.get(model)
        if route is None:
            return []
        return [r for b in route.backends if (r := self._replicas.get((route.owner, b.key)))]

    def of_owner(self, owner: str) -> list[Replica]:
        """An InferenceDeployment's replicas, whichever of its names they serve."""
        return [r for (o, _), r in self._replicas.items() if o == owner]

    def healthy(self, model: str) -> bool:
        return any(r.healthy and not r.draining for r in self.replicas(model))

    async def until_healthy(self, model: str) -> None:
        """Returns once `model` has a healthy replica (at once if it has one now)."""
        while not self.healthy(model):
            await self._came_in.wait()

    def _wake(self) -> None:
        self._came_in.set()
        self._came_in = asyncio.Event()

    def order(self, model: str, prompt: str) -> list[Replica]:
        reps = {r.backend.key: r for r in self.replicas(model)}
        return [reps[v.key] for v in order([r.view() for r in reps.values()], prompt, self.policy)]

    def ready(self) -> bool:
        """A replica answers, or discovery found no model at all: a site without models yet
        (a fresh `helm install --wait`, before its first InferenceDeployment) has nothing a
        gateway could fail at, and waiting for a model there would fail the install."""
        if self.synced and not self.routes:
            return True
        return any(r.healthy for r in self._replicas.values())

    def mark_down(self, replica: Replica) -> None:
        if replica.healthy:
            log.warning("replica %s is out: it refused a connection", replica.backend.key)
        replica.healthy, replica.failures = False, FAILURES_TO_EJECT

    async def probe(self, client: aiohttp.ClientSession, replica: Replica) -> None:
        try:
            async with client.get(
                f"{replica.backend.url}{STATE_PATH}",
                headers=replica.auth(),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                raise_for_status=True,
            ) as resp:
                state = read_admin_state(await resp.read())
            replica.batch_limit, replica.capacity = state.max_batch_size, state.capacity
            replica.active, replica.queued = state.active_sequences, state.queue_depth
            replica.reason, replica.draining = state.thermal_reason, state.draining
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            replica.failures += 1
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            if replica.healthy and (refused or replica.failures >= FAILURES_TO_EJECT):
                log.warning("replica %s is out: %r", replica.backend.key, exc)
                replica.healthy = False
            return
        came_in = not replica.healthy
        replica.healthy, replica.failures, replica.probed_at = True, 0, time.monotonic()
        if came_in:
            log.info("replica %s is in", replica.backend.key)
            self._wake()

    async def probe_forever(self, client: aiohttp.ClientSession) -> None:
        while True:
            self._changed.clear()
            replicas = list(self._replicas.values())
            await asyncio.gather(*(self.probe(client, r) for r in replicas))
            with contextlib.suppress(TimeoutError):  # new replicas are probed at once
                await asyncio.wait_for(self._changed.wait(), self.interval)
