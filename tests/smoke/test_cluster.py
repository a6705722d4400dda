"""Smoke tests of the local real cluster's control plane and kwok fleet: the parts every other
suite stands on (the real kubelet node's: test_node.py)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from tests.cluster.fleet import SIM_TOLERATION
from tests.conftest import Kube
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.ember.dev"},
    "spec": {
        "group": "smoke.ember.dev",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                            "status": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            },
                        },
                    }
                },
            }
        ],
    },
}


def crd_established(kube: Kube, name: str) -> bool:
    crd = client.ApiextensionsV1Api(kube.api).read_custom_resource_definition(name)
    conds = (crd.status.conditions if crd.status else None) or []
    return any(c.type == "Established" and c.status == "True" for c in conds)


@pytest.fixture(scope="module")
def widget_crd(kube: Kube) -> str:
    try:
        utils.create_from_dict(kube.api, WIDGET_CRD)
    except utils.FailToCreateError as exc:
        assert all(e.status == 409 for e in exc.api_exceptions)
    wait_for("Widget CRD Established", lambda: crd_established(kube, "widgets.smoke.ember.dev"))
    return "widgets.smoke.ember.dev"


def test_crd_becomes_established(widget_crd: str, kube: Kube) -> None:
    assert crd_established(kube, widget_crd)
    assert "widgets" in kube.kubectl("api-resources", "--api-group=smoke.ember.dev")


OPERATOR = """
import kopf

@kopf.on.startup()
def configure(settings, **_):
    settings.persistence.finalizer = "smoke.ember.dev/finalizer"
    settings.posting.enabled = False

@kopf.on.create("smoke.ember.dev", "v1", "widgets")
def created(spec, patch, **_):
    patch.status["doubled"] = spec.get("size", 0) * 2
"""


def test_kopf_operator_round_trip(
    widget_crd: str, kube: Kube, namespace: str, tmp_path: Any
) -> None:
    from kopf.testing import KopfRunner

    script = tmp_path / "op.py"
    script.write_text(OPERATOR)
    custom = client.CustomObjectsApi(kube.api)
    body = {
        "apiVersion": "smoke.ember.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 21},
    }
    args = ["run", "--standalone", f"--namespace={namespace}", str(script)]
    with KopfRunner(args) as runner:
        custom.create_namespaced_custom_object("smoke.ember.dev", "v1", namespace, "widgets", body)

        def doubled() -> bool:
            obj: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
                "smoke.ember.dev", "v1", namespace, "widgets", "w1"
            )
            return bool(obj.get("status", {}).get("doubled") == 42)

        wait_for("the operator to patch status.doubled", doubled, timeout=30)
        custom.delete_namespaced_custom_object("smoke.ember.dev", "v1", namespace, "widgets", "w1")
        wait_for(
            "the finalizer to release the object",
            lambda: not widgets(custom, namespace),
            timeout=30,
        )
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    assert "Traceback" not in runner.output


def widgets(custom: client.CustomObjectsApi, namespace: str) -> list[Any]:
    listing: dict[str, Any] = custom.list_namespaced_custom_object(  # type: ignore[assignment]
        "smoke.ember.dev", "v1", namespace, "widgets"
    )
    return list(listing["items"])


def test_api_server_serves_watches_from_now_with_bookmarks(kube: Kube) -> None:
    """kwok (and client-go's streaming lists) open watches with bookmarks and no resourceVersion.
    A 1.36 API server serves them only when etcd answers progress requests (3.5.13+); on
    Debian's etcd 3.4 it sends one ERROR event instead, and kwok falls back to re-listing on a
    backoff of up to 30 s: nodes turn Ready, and leases renew, that late."""
    path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    query = "watch=1&allowWatchBookmarks=true&sendInitialEvents=true&timeoutSeconds=2"
    resp = kube.api.rest_client.pool_manager.request(
        "GET", f"{kube.api.configuration.host}{path}?{query}&resourceVersionMatch=NotOlderThan"
    )
    events = [json.loads(line) for line in resp.data.decode().splitlines() if line.strip()]
    assert resp.status == 200, resp.data[:400]
    assert events, "the watch sent nothing, not even the end-of-initial-events bookmark"
    assert all(e["type"] != "ERROR" for e in events), events[-1]
    # Live changes (lease renewals) and periodic bookmarks may follow within the 2 s.
    ends = [
        e
        for e in events
        if e["type"] == "BOOKMARK"
        and (e["object"]["metadata"].get("annotations") or {}).get("k8s.io/initial-events-end")
        == "true"
    ]
    assert len(ends) == 1, [e["type"] for e in events]


def test_fleet_of_200_nodes_takes_a_200_replica_deployment(
    fleet: Callable[..., list[str]], kube: Kube, namespace: str
) -> None:
    names = fleet(200)
    assert len(names) == 200

    def ready_nodes() -> int:
        nodes = kube.core.list_node(label_selector="ember.dev/fleet=true").items
        return sum(
            any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
            for n in nodes
            if n.status
        )

    wait_for("200 kwok nodes Ready", lambda: ready_nodes() >= 200, 120)
    deployment = yaml.safe_load(f"""
apiVersion: apps/v1
kind: Deployment
metadata: {{name: spread}}
spec:
  replicas: 200
  selector: {{matchLabels: {{app: spread}}}}
  template:
    metadata: {{labels: {{app: spread}}}}
    spec:
      tolerations:
      - {{key: {SIM_TOLERATION["key"]}, operator: Equal, value: "true", effect: NoSchedule}}
      nodeSelector: {{ember.dev/fleet: "true"}}
      topologySpreadConstraints:
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule,
         labelSelector: {{matchLabels: {{app: spread}}}}}}
      containers: [{{name: c, image: fake, resources: {{requests: {{cpu: 10m}}}}}}]
""")
    utils.create_from_dict(kube.api, deployment, namespace=namespace)

    def ready_replicas() -> int:
        dep = client.AppsV1Api(kube.api).read_namespaced_deployment("spread", namespace)
        return int(dep.status.ready_replicas or 0) if dep.status else 0

    wait_for("200 replicas Ready", lambda: ready_replicas() == 200, 180)
    pods = kube.core.list_namespaced_pod(namespace, label_selector="app=spread").items
    per_node = Counter(str(p.spec.node_name) for p in pods if p.spec)
    assert len(per_node) == 200, per_node.most_common(3)
    assert all(name.startswith("kwok-") for name in per_node)
