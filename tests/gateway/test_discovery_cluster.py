"""Discovery on the real API server, with the chart's own RBAC and a ServiceAccount token: the
gateway routes a model to its ready replicas on its site's nodes (kwok nodes and pods), reads
the model's API key from the one Secret it may read, refuses a second InferenceDeployment with
the same model name, and keeps its routes while the API server is unreachable."""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.gateway.discovery import KubeDiscovery
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.policy import Policy
from ember_runtime.kube import Endpoint, KubeClient
from kubernetes import client

from tests.cluster.fleet import create_nodes, node_manifest
from tests.conftest import Kube
from tests.gateway.kube_site import applied_gateway_rbac, gateway_token, ips, pod
from tests.operator.conftest import crd
from tests.operator.specs import manifest
from tests.support.waiting import wait_async
from tests.thermal.kube_support import TcpProxy, api_server

pytestmark = pytest.mark.cluster
__all__ = ["crd"]  # the fixture


def test_discovery_with_the_charts_rbac_and_offline(
    kube: Kube, crd: Any, namespace: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    here, there = f"gw-{tag}-here", f"gw-{tag}-there"
    site = f"site-{tag}"
    create_nodes(kube.api, [node_manifest(here, site), node_manifest(there, f"other-{tag}")])
    try:
        with applied_gateway_rbac(kube, namespace, site, ("alpha-key",), tmp_path):
            _scenario(kube, namespace, tmp_path, here=here, there=there, site=site)
    finally:
        for node in (here, there):
            kube.core.delete_node(node)


def _scenario(kube: Kube, ns: str, tmp: Path, *, here: str, there: str, site: str) -> None:
    for name, value in (("alpha-key", "alpha-secret"), ("private", "not-for-the-gateway")):
        secret = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name), string_data={"key": value}
        )
        kube.core.create_namespaced_secret(ns, secret)
    sa = gateway_token(kube, ns, tmp / "sa")
    key_ref = {"apiKeySecretRef": {"name": "alpha-key", "key": "key"}, "port": 8081}
    for body in (manifest("alpha", server=key_ref), manifest("beta")):
        body["spec"]["model"]["name"] = body["metadata"]["name"]
        client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
            "ember.dev", "v1alpha1", ns, "inferencedeployments", body
        )
    time.sleep(1.1)  # creationTimestamp has whole seconds: the duplicate is younger
    dup = manifest("alpha-again")
    dup["spec"]["model"]["name"] = "alpha"
    client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        "ember.dev", "v1alpha1", ns, "inferencedeployments", dup
    )
    pods = {"alpha-0": ("alpha", here), "alpha-1": ("alpha", there), "beta-0": ("beta", here)}
    for name, (instance, node) in pods.items():
        kube.core.create_namespaced_pod(ns, pod(name, instance, node))  # type: ignore[arg-type]
    pod_ips = ips(kube, ns, list(pods))
    _least_privilege(kube, sa, ns)

    proxy = TcpProxy(api_server(kube))
    proxy.restore()
    endpoint = Endpoint(f"https://127.0.0.1:{proxy.port}", sa / "token", sa / "ca.crt")
    try:
        asyncio.run(_discover(kube, ns, endpoint, site=site, pod_ips=pod_ips, proxy=proxy, tmp=tmp))
    finally:
        proxy.cut()


def _least_privilege(kube: Kube, sa: Path, ns: str) -> None:
    """The chart's Role: read the Secret it names, nothing else; write nothing."""
    with httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
    ) as http:
        assert http.get(f"/api/v1/namespaces/{ns}/secrets/alpha-key").status_code == 200
        assert http.get(f"/api/v1/namespaces/{ns}/secrets/private").status_code == 403
        assert http.get(f"/api/v1/namespaces/{ns}/secrets").status_code == 403
        patch = http.patch(
            f"/apis/ember.dev/v1alpha1/namespaces/{ns}/inferencedeployments/alpha",
            content=b'{"spec": {"replicas": 3}}',
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert patch.status_code == 403
        assert http.delete(f"/api/v1/namespaces/{ns}/pods/alpha-0").status_code == 403


async def _discover(
    kube: Kube,
    ns: str,
    endpoint: Endpoint,
    *,
    site: str,
    pod_ips: dict[str, str],
    proxy: TcpProxy,
    tmp: Path,
) -> None:
    snapshot = tmp / "routes.json"

    def gateway(fleet: Fleet) -> asyncio.Task[None]:
        discovery = KubeDiscovery(KubeClient(endpoint, timeout=3.0), ns, "", site, snapshot)
        return asyncio.create_task(discovery.run(fleet, GatewayMetrics()))

    fleet, metrics = Fleet(Policy()), GatewayMetrics()
    discovery = KubeDiscovery(KubeClient(endpoint, timeout=3.0), ns, "", site, snapshot)
    task = asyncio.create_task(discovery.run(fleet, metrics))
    try:
        await wait_async(
            "the routes",
            lambda: set(fleet.routes) == {"alpha", "beta"} and bool(fleet.routes["beta"].backends),
            30, 0.1,
        )  # fmt: skip
        alpha, beta = fleet.routes["alpha"], fleet.routes["beta"]
        assert alpha.owner == f"{ns}/alpha" and alpha.api_key == "alpha-secret"
        # only the replica on this site's node; the port from spec.server.port
        assert [b.url for b in alpha.backends] == [f"http://{pod_ips['alpha-0']}:8081"]
        assert [b.url for b in beta.backends] == [f"http://{pod_ips['beta-0']}:8080"]
        assert beta.api_key is None
        assert metrics.registry.get_sample_value("ember_gateway_model_conflicts") == 1

        proxy.cut()  # the API server is gone for the gateway
        await asyncio.to_thread(
            kube.core.delete_namespaced_pod, "beta-0", ns, grace_period_seconds=0
        )
        await asyncio.sleep(4)  # longer than a retry: the watches failed and were retried
        assert fleet.routes["beta"].backends == beta.backends  # the last known set serves
        assert fleet.routes["alpha"] == alpha
        assert snapshot.stat().st_mode & 0o777 == 0o600  # it holds alpha's key
        restarted = Fleet(Policy())  # a gateway restarted while the API server is away
        again = gateway(restarted)
        try:
            await wait_async(
                "restarted: its routes", lambda: restarted.routes == fleet.routes, 5, 0.1
            )
        finally:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)

        proxy.restore()  # back: the watch lists again and sees what changed meanwhile
        await wait_async("the deletion", lambda: not fleet.routes["beta"].backends, 30, 0.1)
        assert fleet.routes["alpha"] == alpha
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
