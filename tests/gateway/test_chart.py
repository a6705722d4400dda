"""The gateway in the Helm chart: off by default, one per site, read-only RBAC."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.chart.test_chart import CHART, KUBE, NAMESPACE, by_kind, helm, render

__all__ = ["helm"]  # the fixture, shared with tests/chart
VALUES = ("-f", str(CHART / "ci" / "gateway-values.yaml"))


def gateway_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if "gateway" in d["metadata"]["name"]]


def test_off_by_default(helm: str) -> None:
    assert gateway_objects(render(helm)) == []


def test_one_gateway_per_site_on_that_sites_nodes(helm: str) -> None:
    docs = render(helm, *VALUES)
    deployments = {d["metadata"]["name"]: d for d in by_kind(gateway_objects(docs), "Deployment")}
    assert sorted(deployments) == ["ember-gateway-plant-a", "ember-gateway-plant-b"]
    a, b = deployments["ember-gateway-plant-a"], deployments["ember-gateway-plant-b"]
    assert a["spec"]["replicas"] == 2 and b["spec"]["replicas"] == 1
    assert a["spec"]["template"]["spec"]["nodeSelector"] == {"ember.dev/site": "plant-a"}
    assert b["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    env = {e["name"]: e["value"] for e in a["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EMBER_GATEWAY_SITE"] == "plant-a"
    assert env["EMBER_GATEWAY_NAMESPACE"] == NAMESPACE
    assert env["EMBER_GATEWAY_SELECTOR"] == "ember.dev/exposed=true"
    container = a["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith("/ember-gateway:" + container["image"].rsplit(":", 1)[1])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert a["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    services = {s["metadata"]["name"]: s for s in by_kind(gateway_objects(docs), "Service")}
    assert services["ember-gateway-plant-a"]["spec"]["selector"]["ember.dev/site"] == "plant-a"


def test_rbac_reads_only_what_it_serves(helm: str) -> None:
    objects = gateway_objects(render(helm, *VALUES))
    (role,) = by_kind(objects, "Role")
    assert role["rules"] == [
        {"apiGroups": ["ember.dev"], "resources": ["inferencedeployments"],
         "verbs": ["get", "list", "watch"]},
        # the scaler's one write: spec.replicas through the scale subresource
        {"apiGroups": ["ember.dev"], "resources": ["inferencedeployments/scale"],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["chat-key", "embed-key"],
         "verbs": ["get"]},
    ]  # fmt: skip
    (nodes,) = by_kind(objects, "ClusterRole")
    assert nodes["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}
    ]
    # no sites: no node access; no Secrets listed: no Secret access at all
    plain = gateway_objects(render(helm, "--set", "gateway.enabled=true"))
    assert by_kind(plain, "ClusterRole") == []
    (role,) = by_kind(plain, "Role")
    assert all("secrets" not in rule["resources"] for rule in role["rules"])
    (deployment,) = by_kind(plain, "Deployment")
    assert deployment["metadata"]["name"] == "ember-gateway"
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("gateway.loadFactor=0.5", "loadFactor"),
        ("gateway.hold.maxRequests=-1", "maxRequests"),
        ("gateway.hold.timeoutSeconds=0", "timeoutSeconds"),
        ("gateway.swapIntervalSeconds=0", "swapIntervalSeconds"),
        ("gateway.port=80", "port"),
        ("gateway.sites[0].name=bad site", "name"),
        ("gateway.unknown=1", "unknown"),
    ],
)
def test_schema_rejects_bad_gateway_values(helm: str, flag: str, message: str) -> None:
    proc = subprocess.run(
        [helm, "template", "ember", str(CHART), *KUBE, "--set", "gateway.enabled=true",
         "--set", flag],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
