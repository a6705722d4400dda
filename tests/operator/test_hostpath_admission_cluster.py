"""Hole 7 (issue 34), hostPath half: an InferenceDeployment may mount only the node directories
the cluster allows (the chart's modelHostPaths.allowed), on the real API server.

The chart's ValidatingAdmissionPolicy + binding are applied as `helm template`
renders them, renamed for this test and bound to its namespace only, so tests running at the
same time elsewhere on the cluster never meet this policy. Objects go in with server-side dry
run, as `kubectl apply --dry-run=server` would send them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.conftest import Kube
from tests.operator.specs import manifest
from tests.support.waiting import wait_for
from tests.thermal.kube_support import chart_objects, kubectl_apply

pytestmark = pytest.mark.cluster

ALLOWED = "/var/lib/ember/models"
NOT_ALLOWED = f"is not in a directory this cluster allows for models ({ALLOWED})"


def _scoped(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The chart's objects under this test's names, the binding matching its namespace only."""
    out = []
    for original in objects:
        o = json.loads(json.dumps(original))
        o["metadata"]["name"] = f"{namespace}-{o['metadata']['name']}"
        spec = o.get("spec") or {}
        if o["kind"] == "ValidatingAdmissionPolicyBinding":
            spec["policyName"] = f"{namespace}-{spec['policyName']}"
            selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            spec["matchResources"] = {"namespaceSelector": selector}
        out.append(o)
    return out


@pytest.fixture
def policy(crd: Kube, namespace: str, tmp_path: Path) -> Iterator[None]:
    objects = _scoped(
        chart_objects("model-hostpath-admission.yaml", namespace=namespace), namespace
    )
    assert {o["kind"] for o in objects} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    kubectl_apply(crd, objects, tmp_path)
    try:
        # The API server compiles a new policy within a second or so: wait until it answers.
        wait_for(
            "the policy to refuse /etc",
            lambda: NOT_ALLOWED in (_refusal(crd, namespace, "/etc") or ""),
            timeout=60,
            interval=0.5,
        )
        yield
    finally:
        for o in objects:
            crd.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found")


def _create(kube: Kube, namespace: str, path: str) -> Any:
    doc = manifest(
        "hp", model={**manifest()["spec"]["model"], "source": {"hostPath": {"path": path}}}
    )
    return client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        "ember.dev", "v1alpha1", namespace, "inferencedeployments", doc, dry_run="All"
    )


def _refusal(kube: Kube, namespace: str, path: str) -> str | None:
    """The API server's message when it refuses `path`, None when it accepts it."""
    try:
        _create(kube, namespace, path)
    except ApiException as err:
        assert err.status in (400, 403, 422), err.body
        return str(json.loads(err.body or "{}")["message"])
    return None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/etc", NOT_ALLOWED),  # the attack: the host's passwd
        ("/", "overlaps the node cache /var/lib/ember/cache"),
        ("/var/lib/ember/models-other", NOT_ALLOWED),  # a prefix that is not the directory
        ("/var/lib/ember", "overlaps the node cache /var/lib/ember/cache"),
        ("/var/lib/ember/cache", "overlaps the node cache /var/lib/ember/cache"),
        ("/var/lib/ember/cache/sha256", "overlaps the node cache /var/lib/ember/cache"),
        (f"{ALLOWED}/../cache", "must not contain '.' or '..' segments"),
        (f"{ALLOWED}/./../../../etc", "must not contain '.' or '..' segments"),
    ],
)
def test_a_host_directory_outside_the_allowed_list_is_refused(
    crd: Kube, namespace: str, policy: None, path: str, message: str
) -> None:
    refused = _refusal(crd, namespace, path)
    assert refused is not None, f"{path} was accepted"
    assert message in refused, refused
    assert "spec.model.source.hostPath.path" in refused or "hostPath.path" in refused, refused


@pytest.mark.parametrize("path", [ALLOWED, f"{ALLOWED}/", f"{ALLOWED}/gemma-3", f"{ALLOWED}/a/.b"])
def test_an_allowed_directory_is_accepted(
    crd: Kube, namespace: str, policy: None, path: str
) -> None:
    assert _refusal(crd, namespace, path) is None
