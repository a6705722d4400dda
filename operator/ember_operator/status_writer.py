"""The one writer of InferenceDeployment status.

Everything that changes status — a reconcile, a pod's readiness or `ember.dev/Thermal`
condition, a Deployment's rollout, a kubelet warning about a pod (`PodEvents`) — calls
`StatusWriter.write`, which computes the whole status
from observed state (pure, `status.build_status`) and patches only the fields that changed. No
Kopf `patch.status` beside it, so two paths can never undo each other's writes; a per-object lock
orders concurrent callers (Kopf runs sync handlers in threads), and the last status written is
the base of the next diff, so a burst of pod events yields one write per real change.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ember_runtime.contract.resource import object_path
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ember_operator import metrics, render, status
from ember_operator.api import API_VERSION, KIND
from ember_operator.apply import namespace_terminating, request
from ember_operator.events import ObjectRef, record_event

log = logging.getLogger(__name__)

Key = tuple[str, str]


class PodEvents:
    """The kubelet's warning Events that keep pods from starting (FailedMount, …), one small
    entry per stuck pod of an InferenceDeployment: they are nowhere in the pod's status, so the
    status writer keeps them beside what the watches deliver. An entry goes when its pod starts
    a container or goes away (`kubelet_events`) or its owner is deleted."""

    # The kubelet follows a volume's own error ("hostPath type check failed: … is not a
    # directory") with a generic timeout after ~2 minutes; the first says what to fix.
    GENERIC = "Unable to attach or mount volumes"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[Key, dict[str, tuple[status.PodFailure, str]]] = {}

    def record(self, key: Key, pod: str, failure: status.PodFailure, at: str) -> bool:
        """Keep the newest warning for `pod` (`at`: its RFC 3339 time); True if it changed."""
        with self._lock:
            pods = self._pods.setdefault(key, {})
            old = pods.get(pod)
            if old is not None:
                older, generic = at < old[1], failure.message.startswith(self.GENERIC)
                if older or (generic and old[0].reason == failure.reason) or old[0] == failure:
                    return False
            pods[pod] = (failure, at)
            return True

    def forget(self, key: Key, pod: str | None = None) -> None:
        """Drop one pod's entry, or all of `key`'s when `pod` is None."""
        with self._lock:
            if pod is None:
                self._pods.pop(key, None)
                return
            pods = self._pods.get(key, {})
            pods.pop(pod, None)
            if not pods:
                self._pods.pop(key, None)

    def pod_changed(self, key: Key, body: Mapping[str, Any], gone: bool) -> None:
        """A pod event: a pod that runs a container (or is gone) is past whatever the kubelet
        warned about. Called from the pods' one event handler (`handlers.pod_event`)."""
        if gone or status.pod_started(body.get("status") or {}):
            self.forget(key, body["metadata"]["name"])

    def of(self, key: Key) -> dict[str, status.PodFailure]:
        with self._lock:
            return {pod: failure for pod, (failure, _) in self._pods.get(key, {}).items()}


@dataclass(frozen=True)
class Observation:
    deployment: Mapping[str, Any] | None
    pods: list[Mapping[str, Any]]
    problems: list[render.Problem]
    desired: int = 0
    # Whether the spec asks for a thermal policy; None (the spec cannot be read): the thermal
    # status stays what it is. The replicas' reports themselves ride in `pods`.
    adaptive: bool | None = None
    # status.rollout as the rollout step left it (spec.rollout); None: no rollout.
    rollout: dict[str, Any] | None = None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusWriter:
    def __init__(self, api: ApiClient, timeout: float) -> None:
        self._api, self._timeout = api, timeout
        self._locks: dict[Key, threading.Lock] = {}
        self._guard = threading.Lock()
        self._written: dict[Key, tuple[str, dict[str, Any]]] = {}  # key -> (uid, status)
        self.writes = 0
        self.kubelet = PodEvents()

    def _lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def write(self, body: Mapping[str, Any], obs: Observation, *, announce: bool = True) -> bool:
        """Patch what changed; True when a write happened. Raises ApiException on failure."""
        meta = body["metadata"]
        key: Key = (meta["namespace"], meta["name"])
        with self._lock(key):
            cached = self._written.get(key)
            old = (
                cached[1] if cached and cached[0] == meta["uid"] else dict(body.get("status") or {})
            )
            pods = status.with_kubelet_events(obs.pods, self.kubelet.of(key))
            built = status.build_status(
                status.Observed(
                    generation=int(meta.get("generation", 0)),
                    desired=obs.desired,
                    deployment=obs.deployment,
                    pods=pods,
                    problems=obs.problems,
                    selector=render.selector_string(meta["name"]),
                    thermal=None if obs.adaptive is None else status.thermal_of(pods, obs.adaptive),
                    rollout=obs.rollout,
                ),
                old,
                _now(),
            )
            new = status.to_wire(built)  # what the API server holds: the diff's terms
            changed = status.changed_fields(new, old)
            if changed:
                self._patch(key, changed)
            self._written[key] = (meta["uid"], new)
        metrics.record_conditions(key, {c.type: c.status.value for c in built.conditions})
        conds = {c["type"]: c for c in new["conditions"]}
        if announce:
            _announce_degraded(self._api, body, conds[status.DEGRADED], old.get("conditions") or [])
        return bool(changed)

    def last_status(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The status last written for this object, else the one it carries (the watch may
        not have brought our last write back yet)."""
        meta = body["metadata"]
        cached = self._written.get((meta["namespace"], meta["name"]))
        if cached is not None and cached[0] == meta["uid"]:
            return cached[1]
        return dict(body.get("status") or {})

    def is_echo(self, body: Mapping[str, Any]) -> bool:
        """Whether this object's status is exactly the one last written for it: the watch
        bringing back our own write. Most events of a settled object are these echoes,
        and refreshing on each cost the status writers a pass over the indexes apiece."""
        meta = body["metadata"]
        cached = self._written.get((meta["namespace"], meta["name"]))
        return cached is not None and cached[0] == meta["uid"] and body.get("status") == cached[1]

    def _patch(self, key: Key, changed: Mapping[str, Any]) -> None:
        namespace, name = key
        path = f"{object_path(namespace, name)}/status"
        try:
            request(
                self._api,
                "PATCH",
                path,
                body={"status": dict(changed)},  # our own fields: a merge patch is exact here
                content_type="application/merge-patch+json",
                timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status == 404:  # deleted meanwhile: nothing to report on
                return
            raise
        self.writes += 1
        metrics.API_WRITES.labels(kind="InferenceDeployment", verb="status").inc()

    def forget(self, key: Key) -> None:
        with self._guard:
            self._written.pop(key, None)
            self._locks.pop(key, None)
        self.kubelet.forget(key)
        metrics.record_conditions(key, None)


def worth_an_event(degraded: Mapping[str, Any], old: list[Mapping[str, Any]]) -> bool:
    """Whether this Degraded condition is news against the conditions last written."""
    if degraded["status"] != "True":
        return False
    before = next((c for c in old if c.get("type") == status.DEGRADED), {})
    # A new reason only: ModelDownloading's figures change every 30 s while replicas wait (the
    # node agent's live report); the condition carries them, an Event each would be noise.
    return before.get("status") != "True" or before.get("reason") != degraded["reason"]


def _announce_degraded(
    api: ApiClient,
    body: Mapping[str, Any],
    degraded: Mapping[str, Any],
    old: list[Mapping[str, Any]],
) -> None:
    """One Warning Event per new Degraded reason, not one per refresh nor per ModelDownloading
    progress report (those come every 30 s; the condition shows the latest). Posted with our own
    client, not `kopf.warn`: status is written from Kopf's handlers and from the operator's own
    delayed work (coalesced refreshes, retries), where Kopf's event-posting context does not
    exist."""
    if not worth_an_event(degraded, old):
        return
    meta = body["metadata"]
    ref = ObjectRef(API_VERSION, KIND, meta["name"], meta["namespace"], meta["uid"])
    try:
        record_event(client.CoreV1Api(api), ref, degraded["reason"], degraded["message"], "Warning")
    except ApiException as exc:  # the condition is written; the Event is the courtesy copy
        if namespace_terminating(exc):
            return  # the object goes with its namespace: no one will read the Event
        log.warning(
            "event %s for %s/%s not posted: %s",
            degraded["reason"],
            ref.namespace,
            ref.name,
            exc.reason,
        )
