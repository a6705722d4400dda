"""Moving a replica off a hot node, against the real API server (+ controller-manager, scheduler,
kwok) and a real runtime process whose fake sensor we heat.

Two kwok nodes of our own (an extra taint keeps everyone else's pods off them), one Deployment
replica that prefers node A. The runtime process stands in for that replica's runtime container
(kwok pods have no processes), so the loop polls it under the pod's name and node.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ember_operator.thermal import actions
from ember_operator.thermal.actions import EvictionResult, ObjectRef
from ember_operator.thermal.loop import ThermalLoop
from ember_operator.thermal.policy import NodeHeat, ThermalLimits
from ember_operator.thermal.poller import Replica, ReplicaPoller
from kubernetes import client

from tests.cluster.fleet import SIM_TOLERATION, create_nodes, node_manifest, wait_schedulable
from tests.conftest import Kube
from tests.thermal.conftest import API_KEY, FakeThermalTree

pytestmark = pytest.mark.cluster

PRIVATE = {"key": "ember.dev/thermal-test", "value": "true", "effect": "NoSchedule"}
LIMITS = ThermalLimits(critical_celsius=90, critical_for_seconds=2)
SETTLE = 0.6  # real seconds for the runtime to sample a sensor change (it samples every 0.2 s)


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
def wait_for(what: str, check: Callable[[], Any], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


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
    kube: Kube,
    namespace: str,
    two_nodes: tuple[str, str],
    runtime: tuple[Any, FakeThermalTree],
) -> None:
    core, (a, b) = kube.core, two_nodes
    proc, tree = runtime
    apps, policy = client.AppsV1Api(kube.api), client.PolicyV1Api(kube.api)
    dep: Any = apps.create_namespaced_deployment(namespace, _deployment("infer", a, b))
    owner = ObjectRef("apps/v1", "Deployment", "infer", namespace, dep.metadata.uid)
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
    loop = ThermalLoop(core, ReplicaPoller(), NodeHeat(probe_after_seconds=5), lambda: clock[0])

    def replicas() -> list[Replica]:  # each pod's runtime is the one real process
        return [
            Replica(p.metadata.name, p.spec.node_name, proc.url, API_KEY)
            for p in _running_pods(core, namespace, "infer")
        ]

    async def tick(seconds: float = 1.0) -> list[str]:
        clock[0] += seconds
        report = await loop.tick(owner, LIMITS, replicas())
        return report.actions

    async def scenario() -> None:
        try:
            tree.set(0, 95.0)
            await asyncio.sleep(SETTLE)  # the runtime samples its sensor every 0.2 s
            assert await tick() == []  # critical, window running
            assert await tick() == []
            done = await tick()  # 2 s at ≥ 90 °C: vacate — the PDB says not now
            assert done == [f"tainted {a}", f"eviction of {first.metadata.name} blocked by PDB"]
            assert hot_taint(core, a)
            policy.delete_namespaced_pod_disruption_budget("infer", namespace)
            done = await tick()
            assert done == [f"evicted {first.metadata.name}"], done
            moved = wait_for(
                "the replacement pod on B",
                lambda: [
                    p for p in _running_pods(core, namespace, "infer") if p.spec.node_name == b
                ],
            )
            assert moved[0].metadata.name != first.metadata.name
            tree.set(0, 70.0)
            await asyncio.sleep(SETTLE)
            assert await tick() == []  # B is fine; A has no readings yet
            assert hot_taint(core, a)
            done = await tick(5.0)  # no reading from A for probe_after: release to re-probe
            assert done == [f"untainted {a}"]
            assert not hot_taint(core, a)
        finally:
            tree.set(0, 60.0)
            await loop.close()

    asyncio.run(scenario())
    events: list[Any] = core.list_namespaced_event(namespace).items
    reasons = {e.reason for e in events if e.involved_object.name == "infer"}
    assert "ReplicaMovedOffHotNode" in reasons
    on_node: list[Any] = core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={a}"
    ).items
    node_events = {e.reason for e in on_node}
    assert {"HotNodeTainted", "HotNodeReleased"} <= node_events


def test_evicting_a_missing_pod_is_gone(kube: Kube, namespace: str) -> None:
    assert actions.evict(kube.core, namespace, "no-such-pod") is EvictionResult.GONE
