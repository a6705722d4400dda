"""The node agent's write path on the real API server: the chart's ClusterRole, binding and
ValidatingAdmissionPolicy. A token bound to a pod on node A may set node A's ember.dev/Thermal
condition (kwok's conditions stay), and nothing else: not node B, not another condition, not a
label. The policy's expressions must also compile cleanly: it matches nodes/status, which the
kubelet writes too (only its matchConditions keep it away from the kubelet)."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.thermal import (
    THERMAL_CONDITION,
    ThermalReading,
    decode_report,
    thermal_condition,
)
from ember_runtime.kube import ApiError, ConditionPatcher, Endpoint, node_status_path
from kubernetes import client

from tests.cluster.fleet import SIM_TOLERATION, create_nodes, node_manifest
from tests.conftest import Kube
from tests.support.waiting import wait_for
from tests.thermal.kube_support import NODEAGENT_TEMPLATES, chart_objects, kubectl_apply, token_dir

pytestmark = pytest.mark.cluster

AGENT_SA = "ember-nodeagent"
POLICY = "ember-nodeagent-own-node"
SMP = {"Content-Type": "application/strategic-merge-patch+json"}


@pytest.fixture
def agent(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """Two nodes, the chart's node-agent RBAC and policy for `namespace`, an agent pod on node A
    and a token bound to it; yields (node A, node B, token dir)."""
    tag = uuid.uuid4().hex[:6]
    nodes = (f"agent-{tag}-a", f"agent-{tag}-b")
    manifests = [node_manifest(n, "agent-test") for n in nodes]
    for m in manifests:
        m["status"].pop("nodeInfo", None)  # kubernetes>=37 rejects a partial NodeSystemInfo
    create_nodes(kube.api, manifests)
    objects = [
        o
        for o in chart_objects(*NODEAGENT_TEMPLATES, namespace=namespace)
        if o["kind"] != "DaemonSet"
    ]
    kubectl_apply(kube, objects, tmp_path)
    pod: Any = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent"},
        "spec": {
            "serviceAccountName": AGENT_SA,
            "automountServiceAccountToken": False,
            "nodeName": nodes[0],
            "tolerations": [SIM_TOLERATION],
            "containers": [{"name": "agent", "image": "ember-runtime:never"}],
        },
    }
    created: Any = kube.core.create_namespaced_pod(namespace, pod)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],
            expiration_seconds=900,
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name="agent", uid=created.metadata.uid
            ),
        )
    )
    answer: Any = kube.core.create_namespaced_service_account_token(AGENT_SA, namespace, request)
    sa = token_dir(kube, str(answer.status.token), tmp_path / "sa")
    try:
        yield nodes[0], nodes[1], sa
    finally:
        for o in objects:
            if "namespace" not in o["metadata"]:
                kube.kubectl(
                    "delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found"
                )
        for n in nodes:
            kube.core.delete_node(n)


def _http(kube: Kube, sa: Path) -> httpx.Client:
    return httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
        timeout=10,
    )


def _node_conditions(kube: Kube, name: str) -> dict[str, Any]:
    node: Any = kube.core.read_node(name)
    return {c.type: c for c in node.status.conditions or []}


def test_policy_compiles_without_warnings(kube: Kube, agent: tuple[str, str, Path]) -> None:

    def type_checking() -> dict[str, Any] | None:
        policy = json.loads(kube.kubectl("get", "validatingadmissionpolicy", POLICY, "-o", "json"))
        checked: dict[str, Any] | None = (policy.get("status") or {}).get("typeChecking")
        return checked

    what = "the API server to type-check the policy"
    checked = wait_for(what, type_checking, 30, 0.5, until=lambda got: got is not None)
    assert not checked.get("expressionWarnings"), checked


def test_agent_writes_its_own_node_only(kube: Kube, agent: tuple[str, str, Path]) -> None:
    own, other, sa = agent
    with _http(kube, sa) as http:
        review = http.post(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        ).json()
        assert review["status"]["userInfo"]["extra"]["authentication.kubernetes.io/node-name"] == [
            own
        ]
    before = set(_node_conditions(kube, own))
    endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")

    async def write(node: str) -> None:
        patcher = ConditionPatcher(endpoint, node_status_path(node))
        try:
            await patcher.write(
                thermal_condition(ThermalReading("Critical", 93), "2026-01-01T00:00:00Z")
            )
        finally:
            await patcher.aclose()

    with _http(kube, sa) as http:  # a fresh policy takes a moment to load: wait for it

        def probe() -> int:
            # A new value each time: re-writing the value an admitted probe set would be no change.
            label = {"metadata": {"labels": {"ember.dev/probe": uuid.uuid4().hex}}}
            path = node_status_path(own)
            return http.patch(path, content=json.dumps(label), headers=SMP).status_code

        wait_for("the policy to refuse a label", probe, 30, 0.5, until=lambda code: code == 403)
    with pytest.raises(ApiError) as refused:
        asyncio.run(write(other))
    assert refused.value.status == 403 and "own node" in str(refused.value)
    assert THERMAL_CONDITION not in _node_conditions(kube, other)
    asyncio.run(write(own))
    after = _node_conditions(kube, own)
    assert after[THERMAL_CONDITION].reason == "Critical"
    assert decode_report(after[THERMAL_CONDITION].message) == ThermalReading("Critical", 93)
    assert before <= set(after)  # kwok's conditions kept by the merge
    with _http(kube, sa) as http:
        label = http.patch(
            node_status_path(own),
            content=json.dumps({"metadata": {"labels": {"ember.dev/site": "elsewhere"}}}),
            headers=SMP,
        )
        foreign = http.patch(
            node_status_path(own),
            content=json.dumps(
                {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "X"}]}}
            ),
            headers=SMP,
        )
        # Reading Nodes is granted (site sharing lists its site's peers); other namespaces'
        # Secrets and writing other resources are not.
        secrets = http.get("/api/v1/namespaces/kube-system/secrets")
    assert label.status_code == 403 and "only the ember.dev/Thermal" in label.text, label.text
    assert foreign.status_code == 403 and "only the ember.dev/Thermal" in foreign.text
    assert secrets.status_code == 403
