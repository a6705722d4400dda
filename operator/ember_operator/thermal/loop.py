"""One tick of the thermal loop for one InferenceDeployment: poll, push, vacate/release, report.

The operator's timer (every second) calls `ThermalLoop.tick()`; the result carries what to write
into status (`replicaStatuses[].temperatureCelsius/.maxBatchSize`, `hottestCelsius`, the
`Throttled` condition). Kubernetes writes happen only on decisions (taint, evict, Event), never
per sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from ember_operator.thermal import actions
from ember_operator.thermal.actions import EvictionResult, ObjectRef
from ember_operator.thermal.policy import NodeHeat, NodeVerdict, ThermalLimits
from ember_operator.thermal.poller import Observation, Replica, ReplicaPoller

log = logging.getLogger(__name__)
THROTTLED = "Throttled"


@dataclass(frozen=True)
class ThermalReport:
    observations: list[Observation]
    throttled: dict[str, str]  # a condition without times (the status code adds them)
    hottest_celsius: float | None
    actions: list[str] = field(default_factory=list)

    def replica_fields(self) -> dict[str, dict[str, Any]]:
        """pod -> the `replicaStatuses[]` fields this loop owns."""
        return {o.pod: o.as_status() for o in self.observations if o.as_status()}


def throttled_condition(
    observations: Sequence[Observation], limits: ThermalLimits
) -> dict[str, str]:
    if not limits.adaptive:
        return {
            "type": THROTTLED,
            "status": "False",
            "reason": "ThermalPolicyOff",
            "message": "thermal.policy is off",
        }
    reduced = [
        o
        for o in observations
        if o.max_batch_size is not None and o.max_batch_size < limits.max_batch
    ]
    if not reduced:
        return {
            "type": THROTTLED,
            "status": "False",
            "reason": "FullBatch",
            "message": f"all replicas run at max batch {limits.max_batch}",
        }
    parts = [
        f"{o.pod} at {o.temperature_celsius or 0:.0f} °C: batch {o.max_batch_size}/"
        f"{limits.max_batch}"
        for o in reduced
    ]
    return {
        "type": THROTTLED,
        "status": "True",
        "reason": "ThermalThrottling",
        "message": "; ".join(parts)[:512],
    }


def _node_temps(observations: Sequence[Observation]) -> dict[str, float]:
    hottest: dict[str, float] = {}
    for o in observations:
        if o.node and o.temperature_celsius is not None:
            hottest[o.node] = max(o.temperature_celsius, hottest.get(o.node, o.temperature_celsius))
    return hottest


class ThermalLoop:
    """Operator-wide: one HTTP session and one `NodeHeat` shared by every InferenceDeployment."""

    def __init__(
        self,
        core: client.CoreV1Api,
        poller: ReplicaPoller | None = None,
        heat: NodeHeat | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core, self.poller = core, poller or ReplicaPoller()
        self.heat, self._clock = heat or NodeHeat(), clock

    async def start(self) -> None:
        """Adopt nodes this operator (or a previous instance) tainted."""
        for node in await asyncio.to_thread(actions.tainted_hot_nodes, self.core):
            self.heat.adopt(node, self._clock())

    async def close(self) -> None:
        await self.poller.close()

    async def tick(
        self, owner: ObjectRef, limits: ThermalLimits, replicas: Sequence[Replica]
    ) -> ThermalReport:
        observations = await self.poller.poll(replicas, limits)
        done: list[str] = []
        now = self._clock()
        for node, temp in sorted(_node_temps(observations).items()):
            verdict = self.heat.observe(node, temp, limits, now)
            if verdict is NodeVerdict.VACATE:
                done += await self._vacate(owner, node, temp, limits, observations)
            elif verdict is NodeVerdict.RELEASE:
                done += await self._release(node, f"cooled to {temp:.1f} °C")
        for node in self.heat.stale(now):
            done += await self._release(node, "no reading for a while: re-probing")
        hottest = max(
            (o.temperature_celsius for o in observations if o.temperature_celsius is not None),
            default=None,
        )
        return ThermalReport(observations, throttled_condition(observations, limits), hottest, done)

    async def _vacate(
        self,
        owner: ObjectRef,
        node: str,
        temp: float,
        limits: ThermalLimits,
        observations: Sequence[Observation],
    ) -> list[str]:
        done = []
        if await asyncio.to_thread(actions.taint_hot, self.core, node):
            done.append(f"tainted {node}")
            await asyncio.to_thread(
                actions.record_event,
                self.core,
                ObjectRef("v1", "Node", node),
                "HotNodeTainted",
                f"{temp:.1f} °C ≥ {limits.critical_celsius:.0f} °C for "
                f"{limits.critical_for_seconds:.0f} s: {actions.HOT_TAINT_KEY} taint added",
                "Warning",
            )
        self.heat.mark_tainted(node, self._clock())
        namespace = owner.namespace or "default"
        for o in observations:
            if o.node != node:
                continue
            result = await asyncio.to_thread(actions.evict, self.core, namespace, o.pod)
            if result is EvictionResult.EVICTED:
                done.append(f"evicted {o.pod}")
                await asyncio.to_thread(
                    actions.record_event,
                    self.core,
                    owner,
                    "ReplicaMovedOffHotNode",
                    f"evicted {o.pod} from {node}: {temp:.1f} °C for ≥ "
                    f"{limits.critical_for_seconds:.0f} s",
                    "Warning",
                )
            elif result is EvictionResult.BLOCKED:
                done.append(f"eviction of {o.pod} blocked by PDB")
        return done

    async def _release(self, node: str, why: str) -> list[str]:
        changed = await asyncio.to_thread(actions.untaint_hot, self.core, node)
        self.heat.mark_released(node)
        if not changed:
            return []
        await asyncio.to_thread(
            actions.record_event,
            self.core,
            ObjectRef("v1", "Node", node),
            "HotNodeReleased",
            f"{why}: {actions.HOT_TAINT_KEY} taint removed",
        )
        return [f"untainted {node}"]
