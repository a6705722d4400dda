"""The kubelet's warning Events about Ember's pods: which ones matter, and whose they are.

A pod whose volume cannot be mounted (a `hostPath` model directory missing on the node) waits
in ContainerCreating forever: its status says nothing more, only an Event does. So the operator
watches Events too, filtered by the API server to warnings about pods (`FIELD_SELECTOR`: field
selectors have no "in", so the reasons are picked here), keeps one small entry per stuck pod of
an InferenceDeployment (`status_writer.PodEvents`, dropped when the pod starts or goes) and
refreshes the owner's status, where it becomes `Degraded` with the kubelet's reason and
message. The Kopf handler is in `handlers` (wiring only), the refresh in `controller`; nothing
here imports them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ember_runtime.contract import reasons

from ember_operator import status
from ember_operator.context import Context
from ember_operator.reconcile import pods_of

EVENTS = ("v1", "events")
# Server-side: only warnings, only about pods. What is left is small (a stuck pod's kubelet
# repeats one Event with a growing count rather than posting new ones).
FIELD_SELECTOR = "involvedObject.kind=Pod,type=Warning"
# Not Kopf's per-object logger: a warning there would be posted as an Event about the Event.
log = logging.getLogger(__name__)


def owner_of(pod: str) -> str | None:
    """The InferenceDeployment a Deployment's pod belongs to: `<owner>-<rs hash>-<suffix>`. A
    guess that the pod index confirms (`_ours`); Events carry no labels."""
    parts = pod.rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[0] else None


def pod_warning(event: Mapping[str, Any]) -> tuple[str, str, status.PodFailure, str] | None:
    """(namespace, pod, failure, time) of a kubelet warning that keeps a pod from starting;
    None for every other Event."""
    involved = event.get("involvedObject") or {}
    reason = str(event.get("reason") or "")
    if involved.get("kind") != "Pod" or reason not in reasons.POD_EVENT_REASONS:
        return None
    series = event.get("series") or {}
    at = (
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )
    failure = status.PodFailure(reason, str(event.get("message") or ""))
    # To the second: `eventTime` has microseconds, `lastTimestamp` not; both are UTC.
    return str(involved.get("namespace")), str(involved.get("name")), failure, str(at)[:19]


def _ours(indexes: Mapping[str, Any], key: tuple[str, str], pod: str) -> bool:
    return any(p.get("pod") == pod for p in pods_of(indexes, key))


def record(
    ctx: Context, event: Mapping[str, Any], body: Mapping[str, Any]
) -> tuple[str, str] | None:
    """A kubelet warning about a pod: the owner whose status must be recomputed when it is
    one of Ember's and says something new (recorded for the status writer), else None."""
    if event.get("type") == "DELETED":  # expired (1 h TTL): says nothing of now
        return None
    found = pod_warning(body)
    if found is None:
        return None
    namespace, pod, failure, at = found
    owner = owner_of(pod)
    if owner is None or not _ours(ctx.indexes, (namespace, owner), pod):
        return None
    if not ctx.writer.kubelet.record((namespace, owner), pod, failure, at):
        return None
    return namespace, owner
