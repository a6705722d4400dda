"""Hot nodes: one operator-wide queue of delayed actions.

Inputs:
- a replica's `ember.dev/Thermal` condition, from the operator's pod watch: `Critical` marks its
  node critical, with that InferenceDeployment's `criticalForSeconds` as the window;
- the node agent's `ember.dev/Thermal` condition on a tainted Node: the only report left once its
  replicas are gone, so it is what releases the taint (`Normal`: below the policy's
  throttle − hysteresis).

Delayed work — the end of a critical window, a retry of an eviction a PodDisruptionBudget
blocked, the next look at a tainted node's condition — goes into one heap served by one task,
instead of a timer per object.

Why tainted nodes are re-read (every `CHECK_SECONDS`) rather than watched: a watch over Nodes
would make the operator serve a cluster-scoped resource even when it serves a few namespaces
(Kopf's namespaced peering does not cover it), and every node status update of the fleet would
cross it. Tainted nodes are few — none in a healthy fleet — so reading just those costs one GET
per hot node per 10 s and nothing otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ember_runtime.contract.thermal import REASON_CRITICAL, REASON_NORMAL
from kubernetes import client

from ember_operator.api import API_VERSION, KIND
from ember_operator.events import ObjectRef, record_event
from ember_operator.thermal import actions
from ember_operator.thermal.actions import EvictionResult

log = logging.getLogger(__name__)

EVICTION_RETRY_SECONDS = 10.0
CHECK_SECONDS = 10.0
DEFAULT_WINDOW_SECONDS = 60.0
VACATE, CHECK = "vacate", "check"


@dataclass(frozen=True)
class Replica:
    namespace: str
    pod: str
    owner: str  # the InferenceDeployment's name
    node: str


@dataclass
class NodeState:
    critical_since: float | None = None
    window: float = DEFAULT_WINDOW_SECONDS
    tainted: bool = False
    critical_pods: set[Replica] = field(default_factory=set)
    node_critical: bool = False  # the node agent says so


class HotNodes:
    """Node heat for the whole fleet. Methods are called from Kopf's handler threads (sync
    handlers) and from the queue task; `lock` guards the state."""

    def __init__(
        self,
        core: client.CoreV1Api,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core, self._clock = core, clock
        self.nodes: dict[str, NodeState] = {}
        self.replicas: dict[str, set[Replica]] = {}  # node -> Ember pods on it
        self._heap: list[tuple[float, str, str]] = []  # (due, what, node)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.done: list[str] = []  # what was done, newest last (tests and logs)
        # Handlers call in from Kopf's threads, the queue from its own: one lock, re-entrant
        # because a node report may release a taint while holding it.
        self.lock = threading.RLock()

    # --- inputs ------------------------------------------------------------------------------

    def adopt_tainted(self) -> None:
        """At start: nodes tainted by an earlier operator stay tainted until reported cool."""
        names = actions.tainted_hot_nodes(self.core)
        with self.lock:
            for name in names:
                self.nodes.setdefault(name, NodeState()).tainted = True
                self._schedule(self._clock(), CHECK, name)

    def observe_pod(self, replica: Replica, critical: bool, window: float | None) -> None:
        with self.lock:
            self._observe_pod(replica, critical, window)

    def _observe_pod(self, replica: Replica, critical: bool, window: float | None) -> None:
        pods = self.replicas.setdefault(replica.node, set())
        pods.add(replica)
        state = self.nodes.setdefault(replica.node, NodeState())
        if critical:
            state.critical_pods.add(replica)
            state.window = min(window or DEFAULT_WINDOW_SECONDS, state.window)
        else:
            state.critical_pods.discard(replica)
        self._update(replica.node, state)

    def forget_pod(self, replica: Replica) -> None:
        with self.lock:
            self._forget_pod(replica)

    def _forget_pod(self, replica: Replica) -> None:
        self.replicas.get(replica.node, set()).discard(replica)
        state = self.nodes.get(replica.node)
        if state is not None:
            state.critical_pods.discard(replica)
            self._update(replica.node, state)

    def _observe_node(self, node: str, reason: str | None) -> None:
        """The node agent's report: Critical, Throttled (warm), Normal (cool) or None."""
        state = self.nodes.setdefault(node, NodeState())
        state.node_critical = reason == REASON_CRITICAL
        self._update(node, state)
        if reason == REASON_NORMAL and state.tainted and not state.critical_pods:
            self._release(node, "the node agent reports it cool")

    def _update(self, node: str, state: NodeState) -> None:
        critical = state.node_critical or bool(state.critical_pods)
        if not critical:
            state.critical_since = None
            if not state.critical_pods:
                state.window = DEFAULT_WINDOW_SECONDS
            return
        if state.critical_since is None:
            state.critical_since = self._clock()
            self._schedule(state.critical_since + state.window, VACATE, node)

    # --- the queue ---------------------------------------------------------------------------

    def _schedule(self, due: float, what: str, node: str) -> None:
        heapq.heappush(self._heap, (due, what, node))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_due(self) -> list[str]:
        """Everything due now (sync: Kubernetes calls). Returns what was done."""
        with self.lock:
            return self._run_due()

    def _run_due(self) -> list[str]:
        done: list[str] = []
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, what, node = heapq.heappop(self._heap)
            if what == VACATE:
                done += self._vacate_if_still_critical(node, now)
            else:
                done += self._check_tainted(node, now)
        self.done += done
        return done

    async def run(self) -> None:
        """Until cancelled: sleep to the next due action (or a new one), run it in a thread."""
        self._loop = asyncio.get_running_loop()
        while True:
            due = self.next_due()
            timeout = None if due is None else max(0.0, due - self._clock())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            try:
                for line in await asyncio.to_thread(self.run_due):
                    log.info("hot node: %s", line)
            except Exception:  # one failed API call must not stop the queue; its entry is gone,
                # but the next report (or check) queues it again
                log.exception("hot-node action failed")

    # --- actions -----------------------------------------------------------------------------

    def _vacate_if_still_critical(self, node: str, now: float) -> list[str]:
        state = self.nodes.get(node)
        if state is None or state.critical_since is None:
            return []  # cooled down within the window
        if now - state.critical_since < state.window:
            return []  # a newer window started after this entry was queued
        done: list[str] = []
        if actions.taint_hot(self.core, node):
            done.append(f"tainted {node}")
            record_event(
                self.core,
                ObjectRef("v1", "Node", node),
                "HotNodeTainted",
                f"critical for ≥ {state.window:.0f} s: {actions.HOT_TAINT_KEY} taint added",
                "Warning",
            )
        if not state.tainted:
            self._schedule(now + CHECK_SECONDS, CHECK, node)
        state.tainted = True
        blocked = False
        for replica in sorted(self.replicas.get(node, set()), key=lambda r: r.pod):
            result = actions.evict(self.core, replica.namespace, replica.pod)
            if result is EvictionResult.EVICTED:
                done.append(f"evicted {replica.pod}")
                owner = ObjectRef(API_VERSION, KIND, replica.owner, replica.namespace)
                record_event(
                    self.core,
                    owner,
                    "ReplicaMovedOffHotNode",
                    f"evicted {replica.pod} from {node}: critical for ≥ {state.window:.0f} s",
                    "Warning",
                )
            elif result is EvictionResult.BLOCKED:
                done.append(f"eviction of {replica.pod} blocked by PDB")
                blocked = True
        if blocked:  # the PDB allows no disruption now: try again shortly, from the same queue
            self._schedule(now + EVICTION_RETRY_SECONDS, VACATE, node)
        return done

    def _check_tainted(self, node: str, now: float) -> list[str]:
        """Read a tainted node's own report; release it when cool, else look again later."""
        state = self.nodes.get(node)
        if state is None or not state.tainted:
            return []
        before = len(self.done)
        self._observe_node(node, actions.node_thermal_reason(self.core, node))
        if state.tainted:
            self._schedule(now + CHECK_SECONDS, CHECK, node)
        return self.done[before:]

    def _release(self, node: str, why: str) -> None:
        state = self.nodes.setdefault(node, NodeState())
        changed = actions.untaint_hot(self.core, node)
        state.tainted = False
        if changed:
            self.done.append(f"untainted {node}")
            log.info("hot node: untainted %s (%s)", node, why)
            record_event(
                self.core,
                ObjectRef("v1", "Node", node),
                "HotNodeReleased",
                f"{why}: {actions.HOT_TAINT_KEY} taint removed",
            )
