"""The scaler on the real API server, with the chart's gateway RBAC and a token of the gateway's
ServiceAccount: a request held for a model at zero makes its PATCH to the scale subresource
set spec.replicas to 1, idleness brings it back to 0, the token can write spec.replicas through
/scale and nothing else, and an API server that is away costs a logged retry, not the gateway.
Swapping: the real scheduler says a pod does not fit (kwok node, pods sized requests ==
limits), and the scaler scales the idle model down, never the busy one."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.resource import object_path
from ember_runtime.gateway.discovery import KubeDiscovery
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.hold import Holds
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.policy import Policy
from ember_runtime.gateway.scaler import Scaler, scale_writer
from ember_runtime.kube import Endpoint, KubeClient
from kubernetes import client

from tests.cluster.fleet import create_nodes, node_manifest, wait_schedulable
from tests.conftest import Kube
from tests.gateway.kube_site import applied_gateway_rbac, gateway_token, ips, pod
from tests.operator.conftest import crd
from tests.operator.specs import manifest
from tests.support.waiting import wait_async, wait_for
from tests.thermal.kube_support import TcpProxy, api_server

pytestmark = pytest.mark.cluster
__all__ = ["crd"]  # the fixture
SCALING = {"minReplicas": 0, "maxReplicas": 2, "idleSeconds": 5}  # the CRD's least


def spec_replicas(kube: Kube, ns: str, name: str) -> int:
    obj: Any = client.CustomObjectsApi(kube.api).get_namespaced_custom_object(
        "ember.dev", "v1alpha1", ns, "inferencedeployments", name
    )
    return int(obj["spec"]["replicas"])


def test_the_scaler_writes_spec_replicas_through_scale_with_the_charts_rbac(
    kube: Kube, crd: Any, namespace: str, tmp_path: Path
) -> None:
    site = f"site-{uuid.uuid4().hex[:6]}"
    with applied_gateway_rbac(kube, namespace, site, (), tmp_path):
        _scaler_writes(kube, namespace, tmp_path)


def _scaler_writes(kube: Kube, namespace: str, tmp_path: Path) -> None:
    sa = gateway_token(kube, namespace, tmp_path / "sa")
    body = manifest("zeta", replicas=0, scaling=SCALING)
    body["spec"]["model"]["name"] = "zeta"
    client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        "ember.dev", "v1alpha1", namespace, "inferencedeployments", body
    )
    _only_replicas_through_scale(kube, sa, namespace)
    proxy = TcpProxy(api_server(kube))
    proxy.restore()
    endpoint = Endpoint(f"https://127.0.0.1:{proxy.port}", sa / "token", sa / "ca.crt")
    try:
        asyncio.run(_scale(kube, namespace, endpoint, proxy))
    finally:
        proxy.cut()


def _only_replicas_through_scale(kube: Kube, sa: Path, ns: str) -> None:
    """The chart's Role: `get`/`patch` on inferencedeployments/scale; no other write."""
    path = object_path(ns, "zeta")
    merge = {"Content-Type": "application/merge-patch+json"}
    with httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
    ) as http:
        scale = http.get(f"{path}/scale")
        assert scale.status_code == 200 and scale.json()["kind"] == "Scale", scale.text
        assert scale.json()["spec"].get("replicas", 0) == 0  # omitted when 0
        for forbidden in (path, f"{path}/status"):
            got = http.patch(forbidden, content=b'{"spec": {"replicas": 2}}', headers=merge)
            assert got.status_code == 403, (forbidden, got.text)
        assert http.delete(path).status_code == 403
        assert spec_replicas(kube, ns, "zeta") == 0


async def _scale(kube: Kube, ns: str, endpoint: Endpoint, proxy: TcpProxy) -> None:
    fleet, metrics = Fleet(Policy()), GatewayMetrics()
    holds = Holds(fleet, metrics, max_requests=8, timeout=600)
    writer = scale_writer(KubeClient(endpoint, timeout=3.0, watches=False))
    scaler = Scaler(fleet, holds, metrics, writer, interval=0.2)
    discovery = KubeDiscovery(KubeClient(endpoint, timeout=3.0), ns)
    tasks = [asyncio.create_task(discovery.run(fleet, metrics))]

    def writes(direction: str) -> float:
        labels = {"deployment": f"{ns}/zeta", "direction": direction}
        return metrics.registry.get_sample_value("ember_gateway_scale_writes_total", labels) or 0

    try:
        await wait_async("zeta's route", lambda: "zeta" in fleet.routes, 30, 0.1)
        assert fleet.routes["zeta"].scaling is not None and fleet.routes["zeta"].replicas == 0
        tasks.append(asyncio.create_task(scaler.run()))
        await asyncio.sleep(1.0)
        assert writes("up") == writes("down") == 0  # no demand: nothing written

        proxy.cut()  # the API server is away: the held request's write fails and is retried
        held = asyncio.create_task(holds.hold("zeta"))
        await asyncio.sleep(2.0)
        assert not held.done() and writes("up") == 0 and not tasks[1].done()
        proxy.restore()
        await wait_async("the scaler's write", lambda: writes("up") == 1, 20, 0.1)
        assert await asyncio.to_thread(spec_replicas, kube, ns, "zeta") == 1
        await wait_async("the watch to bring it back", lambda: fleet.routes["zeta"].replicas == 1)

        held.cancel()  # the client went away: no demand; idleSeconds later, back to zero
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await wait_async("the scale-down", lambda: writes("down") == 1, 20, 0.1)
        assert await asyncio.to_thread(spec_replicas, kube, ns, "zeta") == 0
        assert writes("up") == 1  # written once each way: no flapping
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_a_model_that_does_not_fit_swaps_out_the_idle_model_never_the_busy_one(
    kube: Kube, crd: Any, namespace: str, tmp_path: Path
) -> None:
    """One kwok node of 32Gi; `busy` and `idle` hold 12Gi each, `big` needs 16Gi: its pod is
    Unschedulable. `busy` is the least recently used but has a request in flight: `idle`
    gives up its replica, and nothing else does."""
    tag = uuid.uuid4().hex[:6]
    node, site = f"swap-{tag}", f"site-{tag}"
    create_nodes(kube.api, [node_manifest(node, site)])
    try:
        wait_schedulable(kube.api, [node])
        with applied_gateway_rbac(kube, namespace, site, (), tmp_path):
            sa = gateway_token(kube, namespace, tmp_path / "sa")
            for name, priority in (("busy", 0), ("idle", 0), ("big", 1)):
                scaling = {"maxReplicas": 1, "idleSeconds": 3600, "priority": priority}
                body = manifest(name, replicas=1, scaling=scaling)
                body["spec"]["model"]["name"] = name
                client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
                    "ember.dev", "v1alpha1", namespace, "inferencedeployments", body
                )
            for name, memory in (("busy-0", "12Gi"), ("idle-0", "12Gi")):
                kube.core.create_namespaced_pod(namespace, sized_pod(name, node, memory))
            ips(kube, namespace, ["busy-0", "idle-0"])
            kube.core.create_namespaced_pod(namespace, sized_pod("big-0", node, "16Gi"))
            wait_for("big-0 not to fit", lambda: unschedulable(kube, namespace, "big-0"), 60, 0.5)
            endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")
            asyncio.run(_swap(kube, namespace, endpoint, site))
    finally:
        kube.core.delete_node(node)


def sized_pod(name: str, node: str, memory: str) -> Any:
    """A replica pod of `name`'s InferenceDeployment, sized as the operator sizes them
    (requests == limits), placed by the scheduler onto `node` only."""
    body = pod(name, name.rpartition("-")[0], node)
    del body["spec"]["nodeName"]
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    size = {"cpu": "100m", "memory": memory}
    body["spec"]["containers"][0]["resources"] = {"requests": size, "limits": size}
    return body


def unschedulable(kube: Kube, ns: str, name: str) -> bool:
    got: Any = kube.core.read_namespaced_pod(name, ns)
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in got.status.conditions or []
    )


async def _swap(kube: Kube, ns: str, endpoint: Endpoint, site: str) -> None:
    fleet, metrics = Fleet(Policy()), GatewayMetrics()
    holds = Holds(fleet, metrics, max_requests=8, timeout=600)
    writer = scale_writer(KubeClient(endpoint, timeout=3.0, watches=False))
    scaler = Scaler(fleet, holds, metrics, writer, interval=0.2, swap_interval=1.0)
    discovery = KubeDiscovery(KubeClient(endpoint, timeout=3.0), ns, "", site)
    tasks = [asyncio.create_task(discovery.run(fleet, metrics))]

    def swaps(name: str) -> float:
        labels = {"deployment": f"{ns}/{name}"}
        return metrics.registry.get_sample_value("ember_gateway_swaps_total", labels) or 0

    def replicas() -> dict[str, int]:
        return {n: spec_replicas(kube, ns, n) for n in ("busy", "idle", "big")}

    try:
        await wait_async(
            "the routes: two ready models and one that does not fit",
            lambda: {n for n, r in fleet.routes.items() if r.backends} == {"busy", "idle"}
            and fleet.routes["big"].unschedulable,
            30, 0.1,
        )  # fmt: skip
        scaler.last_used.update({f"{ns}/busy": 1.0, f"{ns}/idle": 2.0})  # busy: the LRU one
        (busy,) = fleet.of_owner(f"{ns}/busy")
        busy.inflight = 1  # a request in flight there, as `proxy.forward` counts it
        tasks.append(asyncio.create_task(scaler.run()))
        await asyncio.sleep(1.0)
        assert swaps("idle") == swaps("busy") == 0  # nothing held for big: no swap
        held = asyncio.create_task(holds.hold("big"))
        await wait_async("the swap", lambda: swaps("idle") == 1, 20, 0.1)
        assert await asyncio.to_thread(replicas) == {"busy": 1, "idle": 0, "big": 1}

        # the operator's part: idle's Deployment drops its pod; the scheduler then places big
        await asyncio.to_thread(
            kube.core.delete_namespaced_pod, "idle-0", ns, grace_period_seconds=0
        )
        await wait_async("big scheduled", lambda: bool(fleet.routes["big"].backends), 60, 0.2)
        assert not fleet.routes["big"].unschedulable
        await asyncio.sleep(2.0)  # two swap intervals: no other victim
        assert swaps("busy") == 0 and swaps("idle") == 1
        assert await asyncio.to_thread(replicas) == {"busy": 1, "idle": 0, "big": 1}
        held.cancel()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
