"""Moving replicas off hot nodes: node taint, PDB-respecting eviction, Events (`kubernetes` client).

Why a taint (`ember.dev/hot=true:NoSchedule`) and not node affinity on the pod template:
- A taint is node-scoped: one write keeps *every* InferenceDeployment's new replicas off the hot
  node, and one write releases it; affinity would be per workload and per node.
- Changing affinity changes the pod template, i.e. a rollout of every replica of the workload —
  exactly the disruption we are trying to limit to the one hot replica.
- It is visible where operators look: `kubectl describe node` shows the taint and the Events.
- NoSchedule (not NoExecute) so the kubelet does not kill other pods on that node; we choose
  which pod moves and go through the Eviction API, so the PodDisruptionBudget is respected.
- Cost: RBAC `nodes: get, list, patch` (cluster-scoped), `pods/eviction: create`, and
  `events: create` for the Events that say so (`ember_operator.events`).

All calls are synchronous (the `kubernetes` client); call them from a thread
(`asyncio.to_thread`) inside Kopf handlers.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from ember_runtime.contract.thermal import parse_thermal_condition
from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

HOT_TAINT_KEY = "ember.dev/hot"
HOT_TAINT: dict[str, str] = {"key": HOT_TAINT_KEY, "value": "true", "effect": "NoSchedule"}
_CONFLICT_RETRIES = 5


class EvictionResult(enum.Enum):
    EVICTED = "evicted"
    BLOCKED = "blocked"  # 429: the PDB allows no disruption now; retry on a later tick
    GONE = "gone"  # 404: the pod is already gone


def _taints(node: Any) -> list[dict[str, Any]]:
    raw = (node.spec.taints if node.spec else None) or []
    return [{k: v for k, v in t.to_dict().items() if v is not None} for t in raw]


def _has_hot(node: Any) -> bool:
    return any(t.get("key") == HOT_TAINT_KEY for t in _taints(node))


def _name(obj: Any) -> str:
    return str(obj.metadata.name)


def _set_taints(core: client.CoreV1Api, name: str, change: bool) -> bool:
    """Add (change=True) or remove the hot taint; True when the node was changed.

    The patch carries the resourceVersion read, so a concurrent writer (kubelet, another
    controller) makes it fail with 409 and we re-read instead of dropping their taint.
    """
    for _ in range(_CONFLICT_RETRIES):
        node: Any = core.read_node(name)
        if _has_hot(node) == change:
            return False
        kept = [t for t in _taints(node) if t.get("key") != HOT_TAINT_KEY]
        wanted = [*kept, HOT_TAINT] if change else kept
        body = {
            "metadata": {"resourceVersion": node.metadata.resource_version},
            "spec": {"taints": wanted},
        }
        try:
            core.patch_node(name, body)
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"node {name}: taint update kept conflicting")


def taint_hot(core: client.CoreV1Api, node: str) -> bool:
    return _set_taints(core, node, change=True)


def untaint_hot(core: client.CoreV1Api, node: str) -> bool:
    return _set_taints(core, node, change=False)


def tainted_hot_nodes(core: client.CoreV1Api) -> list[str]:
    """Nodes carrying the hot taint, to rebuild `NodeHeat` after an operator restart."""
    nodes: list[Any] = core.list_node().items
    return sorted(_name(n) for n in nodes if _has_hot(n))


def node_thermal_reason(core: client.CoreV1Api, name: str) -> str | None:
    """The reason of the node agent's ember.dev/Thermal condition on `name` (None: no report,
    or the node is gone). A plain GET of the Node, which carries its status: GET nodes/status
    is a separate RBAC resource the operator would need a rule for."""
    try:
        node: Any = core.read_node(name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    conditions = [c.to_dict() for c in (node.status.conditions or [])]
    reading = parse_thermal_condition(conditions)
    return None if reading is None else reading.reason


def evict(core: client.CoreV1Api, namespace: str, pod: str) -> EvictionResult:
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=namespace))
    try:
        core.create_namespaced_pod_eviction(pod, namespace, body)
    except ApiException as exc:
        if exc.status == 429:
            log.info("eviction of %s/%s blocked by its PodDisruptionBudget", namespace, pod)
            return EvictionResult.BLOCKED
        if exc.status == 404:
            return EvictionResult.GONE
        raise
    return EvictionResult.EVICTED
