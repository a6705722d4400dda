"""The whole thermal loop: the operator (in-process, KopfRunner) against the real API server, and
a REAL runtime process whose fake sensor we heat.

kwok pods have no processes, so the runtime process stands in for the replica's runtime container:
the InferenceDeployment's `server.port` is the runtime's port and the kwok pod's status says its IP
is 127.0.0.1 (what a kubelet would report, written to the same status subresource). Everything
else is the production path: the pod index, the API key read from the Secret, the poller, the
push to `PUT /admin/batch`, and status written through the resync timer's computation.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from tests.operator import rest
from tests.operator.conftest import crd, operator, wait_for  # noqa: F401 - fixtures
from tests.operator.specs import fleet_manifest
from tests.thermal.conftest import API_KEY, FakeThermalTree
from tests.thermal.runtime_proc import RuntimeProcess

pytestmark = pytest.mark.cluster

SITES = ["site-0", "site-1", "site-2"]
NAME = "warm"
NPU_ZONE, COOL = 1, 70.0  # the session runtime's zone 1 starts at 70 °C


def _status(kube: Any, ns: str) -> dict[str, Any]:
    obj = rest.get(kube.api, "infd", ns, NAME)
    assert obj is not None
    st: dict[str, Any] = obj.get("status") or {}
    return st


def _throttled(st: dict[str, Any]) -> str | None:
    conds: list[dict[str, Any]] = st.get("conditions") or []
    cond = next((c for c in conds if c["type"] == "Throttled"), {})
    return cond.get("status")


def _row(st: dict[str, Any]) -> dict[str, Any]:
    rows = st.get("replicaStatuses") or [{}]
    row: dict[str, Any] = rows[0]
    return row


def _admin_batch(proc: RuntimeProcess) -> int:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    state = httpx.get(f"{proc.url}/admin/state", headers=auth, timeout=5)
    state.raise_for_status()
    return int(state.json()["maxBatchSize"])


def _pod_on_loopback(kube: Any, ns: str) -> str:
    """Wait for the kwok pod to be Ready, then report 127.0.0.1 as its IP."""

    def ready_pod() -> str | None:
        pods = rest.items(kube.api, "pods", ns, label_selector=f"ember.dev/instance={NAME}")
        for pod in pods:
            conds = (pod.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                return str(pod["metadata"]["name"])
        return None

    pod: str = wait_for("a Ready kwok pod", ready_pod, timeout=180)
    rest.request(
        kube.api,
        "PATCH",
        f"{rest.path('pods', ns, pod)}/status",
        body={"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}},
        content_type="application/merge-patch+json",  # replaces the podIPs list
    )
    return pod


def test_heat_throttles_replica_and_status_then_cooling_restores(
    kube: Any,
    namespace: str,
    operator: Any,  # noqa: F811
    fleet: Any,
    runtime: tuple[RuntimeProcess, FakeThermalTree],
) -> None:
    fleet(6, sites=3)
    proc, tree = runtime
    port = int(proc.url.rsplit(":", 1)[1])
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "runtime-key"},
        "data": {"key": base64.b64encode(API_KEY.encode()).decode()},
    }
    kube.core.create_namespaced_secret(namespace, secret)
    body = fleet_manifest(NAME, SITES)
    body["spec"]["server"] = {
        "port": port,
        "apiKeySecretRef": {"name": "runtime-key", "key": "key"},
    }
    rest.create(kube.api, "infd", namespace, body)
    pod = _pod_on_loopback(kube, namespace)
    try:
        cool = wait_for(
            "the cool reading in status",
            lambda: (
                (st := _status(kube, namespace))
                and _row(st).get("maxBatchSize") == 16
                and st.get("hottestCelsius") == COOL
                and st
            ),
            timeout=30,
        )
        assert _row(cool)["pod"] == pod and _row(cool)["temperatureCelsius"] == COOL
        assert _throttled(cool) == "False"

        tree.set(NPU_ZONE, 84.0)
        # The runtime itself runs with the smaller batch within a few seconds...
        wait_for("runtime batch 13", lambda: _admin_batch(proc) == 13, timeout=5)
        # ...and status says so, through the same computation the resync timer uses.
        hot = wait_for(
            "throttled status",
            lambda: (st := _status(kube, namespace)) and _throttled(st) == "True" and st,
            timeout=10,
        )
        assert _row(hot)["maxBatchSize"] == 13 and _row(hot)["temperatureCelsius"] == 84
        assert hot["hottestCelsius"] == 84
        header, row = kube.kubectl("-n", namespace, "get", "infd", NAME).splitlines()[:2]
        assert row.split()[header.split().index("TEMP")] == "84"
        assert row.split()[header.split().index("BATCH")] == "13"

        tree.set(NPU_ZONE, COOL)  # below throttle − hysteresis (75 °C): full batch again
        wait_for("runtime batch 16", lambda: _admin_batch(proc) == 16, timeout=10)
        cooled = wait_for(
            "unthrottled status",
            lambda: (st := _status(kube, namespace)) and _throttled(st) == "False" and st,
            timeout=10,
        )
        assert _row(cooled)["maxBatchSize"] == 16 and cooled["hottestCelsius"] < 75
        # The runtime's EWMA releases slowly (by design); status follows it down to 70 °C.
        wait_for(
            "status at the cool reading",
            lambda: _status(kube, namespace).get("hottestCelsius") == COOL,
            timeout=10,
        )
    finally:
        tree.set(NPU_ZONE, COOL)
