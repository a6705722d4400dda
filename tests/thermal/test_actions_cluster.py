"""Moving a replica off a hot node, against the real API server (+ controller-manager, scheduler,
kwok): the operator-wide hot-node queue with an injected clock.

Two kwok nodes of our own (an extra taint keeps everyone else's pods off them), one Deployment
replica that prefers node A.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from ember_operator.thermal import actions
from ember_operator.thermal.actions import EvictionResult
from ember_operator.thermal.nodes import (
    CHECK_SECONDS,
    EVICTION_RETRY_SECONDS,
    HotNodes,
    Replica,
)
from ember_runtime.contract.thermal import ThermalReading, thermal_condition
from kubernetes import client

from tests.cluster.fleet import SIM_TOLERATION, create_nodes, node_manifest, wait_schedulable
from tests.conftest import Kube
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

PRIVATE = {"key": "ember.dev/thermal-test", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def two_nodes(kube: Kube) -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    names = (f"thermal-{tag}-a", f"thermal-{tag}-b")
    manifests = []
    for name in names:
        m = node_manifest(name, "thermal-test")
        m["spec"]["taints"].append(PRIVATE)
        # kubernetes>=37 validates request bodies: a partial NodeSystemInfo is rejected.
        m["status"].pop("nodeInfo", None)
        manifests.append(m)
    create_nodes(kube.api, manifests)
    wait_schedulable(kube.api, names)  # else the replica may land on B only because A isn't ready
    yield names
    for name in names:
        kube.core.delete_node(name)


# kwok starts pods late when the fleet is busy (minutes while another suite loads 1,000 pods).
def report(core: client.CoreV1Api, node: str, reading: ThermalReading) -> None:
    """What the node agent writes: its condition, strategic-merged into the node's status."""
    cond = thermal_condition(reading, "2026-01-01T00:00:00Z")
    core.patch_node_status(node, {"status": {"conditions": [cond]}})


def taint_keys(core: client.CoreV1Api, node: str) -> list[str]:
    body: Any = core.read_node(node)
    return [t.key for t in body.spec.taints or []]


def hot_taint(core: client.CoreV1Api, node: str) -> bool:
    return actions.HOT_TAINT_KEY in taint_keys(core, node)


def test_taint_is_idempotent_and_keeps_other_taints(kube: Kube, two_nodes: tuple[str, str]) -> None:
    core, (a, _) = kube.core, two_nodes
    assert actions.taint_hot(core, a) is True
    assert actions.taint_hot(core, a) is False
    keys = taint_keys(core, a)
    assert keys.count(actions.HOT_TAINT_KEY) == 1
    assert {"ember.dev/simulated", "ember.dev/thermal-test"} <= set(keys)
    assert a in actions.tainted_hot_nodes(core)
    assert "NoSchedule" in kube.kubectl("describe", "node", a)
    assert actions.untaint_hot(core, a) is True
    assert actions.untaint_hot(core, a) is False
    keys = taint_keys(core, a)
    assert actions.HOT_TAINT_KEY not in keys and "ember.dev/thermal-test" in keys


def _deployment(name: str, a: str, b: str) -> Any:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [{"name": "runtime", "image": "ember-runtime:test"}],
                    "tolerations": [SIM_TOLERATION, {**PRIVATE, "operator": "Equal"}],
                    "terminationGracePeriodSeconds": 0,
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": [a, b],
                                            }
                                        ]
                                    }
                                ]
                            },
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "preference": {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": [a],
                                            }
                                        ]
                                    },
                                }
                            ],
                        }
                    },
                },
            },
        },
    }


def _running_pods(core: client.CoreV1Api, ns: str, app: str) -> list[Any]:
    pods: list[Any] = core.list_namespaced_pod(ns, label_selector=f"app={app}").items
    return [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def test_critical_node_is_vacated_then_released(
    kube: Kube, namespace: str, two_nodes: tuple[str, str]
) -> None:
    """The operator-wide queue, fed as the pod and node watches feed it: a replica reports
    Critical → after the window the node is tainted and the replica evicted (once the PDB
    allows) → the node agent's report of a cool node releases the taint."""
    core, (a, b) = kube.core, two_nodes
    apps, policy = client.AppsV1Api(kube.api), client.PolicyV1Api(kube.api)
    apps.create_namespaced_deployment(namespace, _deployment("infer", a, b))
    first = wait_for(
        "a running pod on A",
        lambda: [p for p in _running_pods(core, namespace, "infer") if p.spec.node_name == a],
    )[0]
    pdb: Any = {
        "metadata": {"name": "infer"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "infer"}}},
    }
    policy.create_namespaced_pod_disruption_budget(namespace, pdb)

    clock = [0.0]
    hot = HotNodes(core, lambda: clock[0])
    replica = Replica(namespace, first.metadata.name, "infer", a)
    hot.observe_pod(replica, critical=True, window=2.0)
    assert hot.next_due() == 2.0
    clock[0] = 1.0
    assert hot.run_due() == []  # window still running
    hot.observe_pod(replica, critical=True, window=2.0)  # a repeat report changes nothing
    clock[0] = 2.0
    done = hot.run_due()  # 2 s critical: vacate — the PDB says not now
    assert done == [f"tainted {a}", f"eviction of {first.metadata.name} blocked by PDB"]
    assert hot_taint(core, a)
    assert hot.next_due() == 2.0 + EVICTION_RETRY_SECONDS  # retried from the same queue
    policy.delete_namespaced_pod_disruption_budget("infer", namespace)
    clock[0] += EVICTION_RETRY_SECONDS
    assert hot.run_due() == [f"evicted {first.metadata.name}"]
    hot.forget_pod(replica)  # the watch's DELETED event
    moved = wait_for(
        "the replacement pod on B",
        lambda: [p for p in _running_pods(core, namespace, "infer") if p.spec.node_name == b],
    )
    assert moved[0].metadata.name != first.metadata.name
    # The node agent's reports on A (as it writes them), read by the queue's checks.
    report(core, a, ThermalReading("Throttled", 80))  # cooler, not cool enough
    clock[0] += CHECK_SECONDS
    assert hot.run_due() == [] and hot_taint(core, a)
    report(core, a, ThermalReading("Normal", 70))
    clock[0] += CHECK_SECONDS
    assert hot.run_due() == [f"untainted {a}"]
    assert not hot_taint(core, a)
    assert hot.next_due() is None  # nothing left to look at

    events: list[Any] = core.list_namespaced_event(namespace).items
    reasons = {e.reason for e in events if e.involved_object.name == "infer"}
    assert "ReplicaMovedOffHotNode" in reasons
    on_node: list[Any] = core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={a}"
    ).items
    node_events = {e.reason for e in on_node}
    assert {"HotNodeTainted", "HotNodeReleased"} <= node_events


def test_a_dip_below_critical_cancels_the_window(kube: Kube, two_nodes: tuple[str, str]) -> None:
    clock = [0.0]
    hot = HotNodes(kube.core, lambda: clock[0])
    replica = Replica("ns", "p", "infer", two_nodes[0])
    hot.observe_pod(replica, critical=True, window=5.0)
    clock[0] = 3.0
    hot.observe_pod(replica, critical=False, window=5.0)
    clock[0] = 4.0
    hot.observe_pod(replica, critical=True, window=5.0)  # a new window: due at 9
    clock[0] = 5.0
    assert hot.run_due() == []  # the first window's entry finds it not critical for 5 s
    assert not hot_taint(kube.core, two_nodes[0])
    assert hot.next_due() == 9.0


def test_evicting_a_missing_pod_is_gone(kube: Kube, namespace: str) -> None:
    assert actions.evict(kube.core, namespace, "no-such-pod") is EvictionResult.GONE
