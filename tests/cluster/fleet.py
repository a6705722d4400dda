"""A simulated edge fleet: kwok fake Nodes that the real scheduler places pods on.

kwok watches Node objects annotated `kwok.x-k8s.io/node=fake`, keeps their leases fresh and
moves pods bound to them to Running/Ready. Fleet nodes carry the taint
`ember.dev/simulated=true:NoSchedule`, so only pods that opt in (a toleration, as the operator
renders from `spec.placement.tolerations`) land there and the real node's tests stay isolated.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, utils

from tests.cluster.control_plane import ControlPlane
from tests.cluster.procs import ProcessTable
from tests.support.net import free_port
from tests.support.waiting import wait_for

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
SIM_TAINT = {"key": "ember.dev/simulated", "value": "true", "effect": "NoSchedule"}
SIM_TOLERATION = {
    "key": "ember.dev/simulated",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}
FLEET_LABEL = "ember.dev/fleet"


def start_kwok(cp: ControlPlane, procs: ProcessTable) -> None:
    if procs.running("kwok"):
        return
    procs.start(
        "kwok",
        [
            str(cp.bins / "kwok"),
            f"--kubeconfig={cp.admin_kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            "--cidr=10.250.0.0/16",
            "--node-ip=10.249.0.1",
            f"--server-address=127.0.0.1:{free_port()}",
            "--node-lease-duration-seconds=40",
        ],
    )


def node_manifest(name: str, site: str, accelerator: str = "npu") -> dict[str, Any]:
    resources = {
        "cpu": "8",
        "memory": "32Gi",
        "pods": "110",
        "ember.dev/npu": "8",
        "nvidia.com/gpu": "1" if accelerator == "nvidia-gpu" else "0",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "ember.dev/site": site,
                "ember.dev/accelerator": accelerator,
                FLEET_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "arm64",
                "type": "kwok",
            },
        },
        "spec": {"taints": [SIM_TAINT]},
        "status": {"allocatable": resources, "capacity": resources, "phase": "Running"},
    }


def create_nodes(api: client.ApiClient, manifests: Iterable[dict[str, Any]]) -> list[str]:
    def create(body: dict[str, Any]) -> str:
        try:
            utils.create_from_dict(api, body)
        except utils.FailToCreateError as exc:
            # Already there is fine: the fleet is idempotent.
            if any(e.status != 409 for e in exc.api_exceptions):
                raise
        return str(body["metadata"]["name"])

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(create, manifests))


def wait_schedulable(api: client.ApiClient, names: Iterable[str], timeout: float = 120) -> None:
    """Until kwok has marked every node Ready and the node controller lifted its not-ready taint.

    A pod created before that is scheduled only among the nodes that are already ready, which
    silently defeats tests that rely on scoring (a preferred node) or on spreading.
    """
    core, pending = client.CoreV1Api(api), set(names)

    def unschedulable() -> list[str]:
        pending.difference_update([n for n in pending if _schedulable(core.read_node(n))])
        return sorted(pending)

    wait_for("the kwok nodes to be schedulable", unschedulable, timeout, until=lambda n: not n)


def _schedulable(node: Any) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    taints = {t.key for t in node.spec.taints or []}
    return ready and not taints & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def ensure_fleet(api: client.ApiClient, n: int, sites: int = 5) -> list[str]:
    """Make (or reuse) n kwok nodes `kwok-<i>` spread over `site-<i % sites>`, ready to schedule."""
    manifests = (node_manifest(f"kwok-{i}", f"site-{i % sites}") for i in range(n))
    names = create_nodes(api, manifests)
    wait_schedulable(api, names, timeout=300)
    return names


def delete_fleet(api: client.ApiClient) -> None:
    client.CoreV1Api(api).delete_collection_node(label_selector=f"{FLEET_LABEL}=true")
