"""The status writer knows its own writes when the watch brings them back, on the real API
server: the merge patch of changed fields must leave exactly the status it computed, or the
operator would take every echo for news (a refresh each) or, worse, take news for an echo."""

from __future__ import annotations

from typing import Any

import pytest
from ember_operator import render
from ember_operator.apply import request
from ember_operator.status_writer import Observation, StatusWriter

from tests.conftest import Kube
from tests.operator import rest
from tests.operator.specs import manifest

pytestmark = pytest.mark.cluster


def _problem(reason: str) -> Observation:
    return Observation(deployment=None, pods=[], problems=[render.Problem(reason, "a message")])


def test_the_watch_echo_of_a_status_write_is_recognised(
    kube: Kube, crd: Any, namespace: str
) -> None:
    rest.create(kube.api, "infd", namespace, manifest("echo"))
    writer = StatusWriter(kube.api, timeout=10)
    before = rest.get(kube.api, "infd", namespace, "echo")
    assert before is not None and not writer.is_echo(before)  # nothing written yet

    assert writer.write(before, _problem("InvalidSpec"), announce=False)
    first = rest.get(kube.api, "infd", namespace, "echo")
    assert first is not None and writer.is_echo(first)

    # A second write patches only what changed; what the server holds is still ours exactly.
    assert writer.write(first, _problem("SharedMemoryTooSmall"), announce=False)
    second = rest.get(kube.api, "infd", namespace, "echo")
    assert second is not None and writer.is_echo(second)
    assert not writer.is_echo(first)  # a late echo of the earlier write is news to refresh

    # Someone else's status change is not an echo either.
    status_path = rest.path("infd", namespace, "echo") + "/status"
    patch = {"status": {"reason": "Other"}}
    request(kube.api, "PATCH", status_path, body=patch, content_type="application/merge-patch+json")
    edited = rest.get(kube.api, "infd", namespace, "echo")
    assert edited is not None and not writer.is_echo(edited)
