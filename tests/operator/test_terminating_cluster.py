"""Writes into a namespace that is being deleted, on the real API server.

A cluster-wide operator sees every namespace's objects, including those whose namespace is
going away: creating a child (or an Event) there is refused with 403 by the API server's
NamespaceLifecycle admission. That refusal is not an RBAC problem and nothing a user can act
on — the object goes with its namespace — so the operator must neither log it as a refusal nor
retry it (CI once failed on exactly these log lines from another test's leftover namespace).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from ember_operator.apply import namespace_terminating
from ember_operator.events import ObjectRef, record_event
from ember_operator.status_writer import _announce_degraded
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.conftest import Kube
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

HOLD = "ember.dev/test-hold"


@pytest.fixture
def terminating(kube: Kube) -> Iterator[str]:
    """A namespace held in Terminating by a ConfigMap with a finalizer of ours."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    held = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="held", finalizers=[HOLD]))
    kube.core.create_namespaced_config_map(name, held)
    kube.core.delete_namespace(name)

    def phase() -> bool:
        ns: client.V1Namespace = kube.core.read_namespace(name)
        return bool(ns.status and ns.status.phase == "Terminating")

    wait_for("namespace Terminating", phase, timeout=30)
    yield name
    kube.core.patch_namespaced_config_map("held", name, {"metadata": {"finalizers": None}})


def test_a_create_in_a_terminating_namespace_is_recognised(kube: Kube, terminating: str) -> None:
    ref = ObjectRef("ember.dev/v1alpha1", "InferenceDeployment", "gone", terminating, "uid-1")
    with pytest.raises(ApiException) as refused:
        record_event(kube.core, ref, "ApplyRejected", "x", "Warning")
    assert namespace_terminating(refused.value), refused.value.body
    # Any other 403 is not this one: a quota refusal must still be reported.
    assert not namespace_terminating(ApiException(status=403, reason="Forbidden"))


def test_the_degraded_event_into_a_terminating_namespace_is_not_a_warning(
    kube: Kube, terminating: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"metadata": {"name": "gone", "namespace": terminating, "uid": "uid-1"}}
    degraded = {"type": "Degraded", "status": "True", "reason": "ApplyRejected", "message": "m"}
    with caplog.at_level(logging.WARNING, logger="ember_operator"):
        _announce_degraded(kube.api, body, degraded, [])
    assert not caplog.records, [r.getMessage() for r in caplog.records]
