"""The runtime's write path on the real API server: its ServiceAccount's RBAC and the chart's
ValidatingAdmissionPolicy. The runtime's own patches (its ember.dev/Thermal and ember.dev/Health
conditions) pass and keep the other writers' conditions; another pod, another condition, a label
or any other status field is refused."""

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
from ember_operator import render
from ember_operator.settings import OperatorSettings
from ember_runtime.contract.rollout import (
    HEALTH_CONDITION,
    HealthReport,
    health_condition,
    parse_health_condition,
)
from ember_runtime.contract.thermal import (
    THERMAL_CONDITION,
    ThermalReading,
    decode_report,
    thermal_condition,
)
from ember_runtime.kube import ConditionPatcher, Endpoint, pod_status_path

from tests.conftest import Kube
from tests.support.waiting import poll, wait_for
from tests.thermal.kube_support import (
    kubectl_apply,
    parked_pod,
    pod_token,
    runtime_policy,
    token_dir,
)

pytestmark = pytest.mark.cluster

SMP = {"Content-Type": "application/strategic-merge-patch+json"}


@pytest.fixture(scope="module")
def policy(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with runtime_policy(kube, tmp_path_factory.mktemp("policy")):
        yield


@pytest.fixture
def pods(
    kube: Kube, namespace: str, policy: None, tmp_path: Path
) -> tuple[Any, Any, httpx.Client, Path]:
    """Two parked pods of the runtime's ServiceAccount (identity as the operator applies it) and
    an HTTP client holding a token bound to the first."""
    kubectl_apply(
        kube,
        [
            {**o, "metadata": {**o["metadata"], "namespace": namespace}}
            for o in render.runtime_identity(namespace, OperatorSettings())
        ],
        tmp_path,
    )
    core = kube.core
    own: Any = core.create_namespaced_pod(namespace, parked_pod("own"))
    other: Any = core.create_namespaced_pod(namespace, parked_pod("other"))
    sa = token_dir(kube, pod_token(core, namespace, own), tmp_path / "sa")
    http = httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
        timeout=10,
    )
    return own, other, http, sa


def _conditions(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    pod: Any = kube.core.read_namespaced_pod(name, namespace)
    return {c.type: c for c in pod.status.conditions or []}


def _wait_scheduled_condition(kube: Kube, namespace: str, name: str) -> None:
    wait_for(
        f"the scheduler to write {name}'s PodScheduled",
        lambda: "PodScheduled" in _conditions(kube, namespace, name),
        30,
        0.2,
    )


def _cond(message: str = "84 °C, batch 13/16", ctype: str = THERMAL_CONDITION) -> dict[str, Any]:
    return {
        "type": ctype,
        "status": "True",
        "reason": "Throttled",
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def _patch(http: httpx.Client, namespace: str, pod: str, body: dict[str, Any]) -> httpx.Response:
    return http.patch(pod_status_path(namespace, pod), content=json.dumps(body), headers=SMP)


def _admitted_eventually(http: httpx.Client, namespace: str, pod: str) -> None:
    """A new policy takes a moment to load: wait until a label write is refused by it."""

    def probe() -> httpx.Response:
        # A new value each time: re-writing the value an admitted probe set would be no change.
        return _patch(http, namespace, pod, {"metadata": {"labels": {"probe": uuid.uuid4().hex}}})

    def refused(resp: httpx.Response) -> bool:
        return resp.status_code >= 400 and "labels" in resp.text

    resp = poll(probe, 30, 0.5, until=refused)
    assert refused(resp), f"the policy never applied: {resp.text}"


def test_token_names_its_pod(kube: Kube, namespace: str, pods: Any) -> None:
    """The extra info the policy relies on is in this API server's tokens."""
    own, _, http, _ = pods
    review = http.post(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert review.status_code == 201, review.text
    user = review.json()["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:ember-runtime"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["own"]
    assert user["extra"]["authentication.kubernetes.io/pod-uid"] == [own.metadata.uid]


def test_own_condition_passes_and_keeps_the_others(kube: Kube, namespace: str, pods: Any) -> None:
    sa = pods[3]
    _wait_scheduled_condition(kube, namespace, "own")
    endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")

    reading = ThermalReading("Throttled", 84, 13, 16)

    async def write() -> None:
        patcher = ConditionPatcher(endpoint, pod_status_path(namespace, "own"))
        try:
            await patcher.write(thermal_condition(reading, "2026-01-01T00:00:00Z"))
        finally:
            await patcher.aclose()

    asyncio.run(write())
    conds = _conditions(kube, namespace, "own")
    assert decode_report(conds[THERMAL_CONDITION].message) == reading
    assert conds[THERMAL_CONDITION].reason == "Throttled"
    assert conds["PodScheduled"].status == "False"  # the scheduler's, kept by the merge


def test_own_health_condition_passes_and_keeps_the_others(
    kube: Kube, namespace: str, pods: Any
) -> None:
    sa = pods[3]
    _wait_scheduled_condition(kube, namespace, "own")
    endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")
    report = HealthReport(
        requests=40, errors=1, ttft_p99_ms=180, throttled=False, window_seconds=300
    )

    async def write() -> None:
        patcher = ConditionPatcher(endpoint, pod_status_path(namespace, "own"))
        try:
            cool = ThermalReading("Normal", 60, 16, 16)
            await patcher.write(thermal_condition(cool, "2026-01-01T00:00:00Z"))
            await patcher.write(health_condition(report, "2026-01-01T00:00:00Z"))
        finally:
            await patcher.aclose()

    asyncio.run(write())
    conds = _conditions(kube, namespace, "own")
    ours = conds[HEALTH_CONDITION]
    raw = {"type": ours.type, "status": ours.status, "reason": ours.reason, "message": ours.message}
    assert parse_health_condition([raw]) == report
    assert ours.reason == "ServerErrors" and ours.status == "False"
    assert conds[THERMAL_CONDITION].reason == "Normal"  # both of the runtime's, side by side
    assert conds["PodScheduled"].status == "False"  # the scheduler's, kept by the merge


ONLY_OURS = "only its ember.dev/Thermal, Health and Adapters conditions"


@pytest.mark.parametrize(
    "case",
    [
        ("other", {"status": {"conditions": [_cond()]}}, "only its own pod's status"),
        (
            "other",
            {"status": {"conditions": [_cond(ctype=HEALTH_CONDITION)]}},
            "only its own pod's status",
        ),
        ("own", {"status": {"conditions": [_cond(ctype="Ready")]}}, ONLY_OURS),
        ("own", {"status": {"conditions": [_cond(ctype="example.com/Other")]}}, ONLY_OURS),
        ("own", {"status": {"conditions": [_cond(ctype="ember.dev/ModelDownload")]}}, ONLY_OURS),
        ("own", {"status": {"conditions": [_cond(ctype="ember.dev/health")]}}, ONLY_OURS),
        ("own", {"metadata": {"labels": {"app": "someone-else"}}}, "labels"),
        ("own", {"metadata": {"annotations": {"a": "b"}}}, "labels, annotations"),
        ("own", {"status": {"message": "all fine here"}}, "of its pod's status"),
        ("own", {"status": {"podIP": "10.0.0.9", "podIPs": [{"ip": "10.0.0.9"}]}}, "status"),
    ],
    ids=[
        "other-pod",
        "other-pod-health",
        "kubelet-condition",
        "foreign-condition",
        "node-agent-condition",
        "health-miscased",
        "label",
        "annotation",
        "status-message",
        "pod-ip",
    ],
)
def test_everything_else_is_refused(
    kube: Kube, namespace: str, pods: Any, case: tuple[str, dict[str, Any], str]
) -> None:
    target, body, refusal = case
    http = pods[2]
    _wait_scheduled_condition(kube, namespace, target)
    _admitted_eventually(http, namespace, "own")
    before: Any = kube.core.read_namespaced_pod(target, namespace)
    resp = _patch(http, namespace, target, body)
    assert resp.status_code == 403, resp.text
    assert refusal in resp.json()["message"], resp.text
    after: Any = kube.core.read_namespaced_pod(target, namespace)
    assert after.metadata.resource_version == before.metadata.resource_version


def test_rbac_allows_nothing_but_pod_status(kube: Kube, namespace: str, pods: Any) -> None:
    _, _, http, _ = pods
    spec_patch = http.patch(
        f"/api/v1/namespaces/{namespace}/pods/own",
        content=json.dumps({"metadata": {"labels": {"x": "y"}}}),
        headers=SMP,
    )
    assert spec_patch.status_code == 403, spec_patch.text  # RBAC: pods/status only
    listing = http.get(f"/api/v1/namespaces/{namespace}/pods")
    assert listing.status_code == 403
    secrets = http.get(f"/api/v1/namespaces/{namespace}/secrets")
    assert secrets.status_code == 403
