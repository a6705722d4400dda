"""Kopf wiring for the kubelet's warning Events about Ember's pods.

A pod whose volume cannot be mounted (a `hostPath` model directory missing on the node) waits
in ContainerCreating forever: its status says nothing more, only an Event does. So the operator
watches Events too, filtered by the API server to warnings about pods
(`involvedObject.kind=Pod,type=Warning`: field selectors have no "in", so the reasons are
picked here), keeps one small entry per stuck pod of an InferenceDeployment
(`status_writer.PodEvents`, dropped when the pod starts or goes) and refreshes the owner's
status, where it becomes `Degraded` with the kubelet's reason and message.

Imported by `handlers` (which registers everything Kopf runs); uses its `refresh`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
from ember_runtime import reasons

from ember_operator import status
from ember_operator.handlers import refresh
from ember_operator.reconcile import Context, pods_of

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


@kopf.on.startup()
def watch_pod_warnings_only(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.watching.field_selectors[EVENTS] = FIELD_SELECTOR


@kopf.on.event(*EVENTS)
def kubelet_event(**kwargs: Any) -> None:
    """A kubelet warning about a pod: if it is one of Ember's and says something new, the
    owner's status is recomputed (and, on a new Degraded reason, one Event is posted)."""
    if kwargs["event"].get("type") == "DELETED":  # expired (1 h TTL): says nothing of now
        return
    found = pod_warning(kwargs["body"])
    if found is None:
        return
    namespace, pod, failure, at = found
    owner = owner_of(pod)
    if owner is None or not _ours(kwargs, (namespace, owner), pod):
        return
    ctx: Context = kwargs["memo"].ctx
    if ctx.writer.kubelet.record((namespace, owner), pod, failure, at):
        refresh(ctx, (namespace, owner), kwargs, log)
