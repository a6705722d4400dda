"""What each watch event does: reconcile an owner, refresh its status, observe its pods,
repair its children. The Kopf decorators that call these are in `handlers` (wiring only);
the clients, caches and indexes they share are the `context.Context`.

- Every InferenceDeployment event → `reconcile` (children, from the indexes) → `status_writer`
  (status); transient failures retry through `requeue`. No timers, no finalizers, nothing of
  Kopf's state written on the objects.
- One watch over Ember's pods (an index of small summaries + an event handler) → the owner's
  status, on change only, and the hot-node queue (`thermal.nodes`).
- Children's events → drift repair (deleted, hand-edited or unwanted children); Deployments'
  events also refresh status (rollout progress).
- The hot-node queue (`thermal.nodes`) re-reads only the nodes it tainted and releases each once
  the node agent's `ember.dev/Thermal` condition says it has cooled.

The operator never calls a runtime: no network path to pods, no API-key Secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from ember_runtime.contract import reasons
from ember_runtime.contract.thermal import REASON_CRITICAL, ThermalReading
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import kubelet_events, metrics, render, status
from ember_operator.apply import DIGEST_ANNOTATION, namespace_terminating
from ember_operator.context import Context
from ember_operator.reconcile import (
    apply_children,
    child_ids,
    child_unchanged,
    correct_child,
    first,
    key_of,
    planned,
    pods_of,
    settled,
)
from ember_operator.rollout import observe as rollout_observe
from ember_operator.rollout import sync as rollout_sync
from ember_operator.status_writer import Observation
from ember_operator.thermal.nodes import Replica

log = logging.getLogger(__name__)
# API errors that need a human (quota, policy, a malformed child): reported, retried slowly.
PERMANENT_STATUSES = frozenset({400, 403, 422})
Key = tuple[str, str]

# ----------------------------------------------------------------------------- index entries


def child_summary(body: Mapping[str, Any], namespace: str | None, labels: Mapping[str, str]) -> Any:
    """What the owner's reconcile and status need of a child: its identity, versions, spec
    digest and status. Not its spec (a Deployment's pod template is most of its size): drift
    is judged on the child's own events, which carry the whole body."""
    key = key_of(namespace, labels)
    if not key:
        return {}
    meta = body["metadata"]
    kept = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "resourceVersion")}
    digest = (meta.get("annotations") or {}).get(DIGEST_ANNOTATION)
    kept["annotations"] = {DIGEST_ANNOTATION: digest} if digest else {}
    return {key: {"metadata": kept, "status": body.get("status") or {}}}


def owner_summary(body: Mapping[str, Any], namespace: str | None, name: str | None) -> Any:
    """The objects (what status needs of them), so a pod event can refresh its owner's status
    without a GET. Not Kopf's annotations: the last-handled copy of the spec doubles the size."""
    meta = body["metadata"]
    kept = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "deletionTimestamp")}
    return {
        (str(namespace), str(name)): {
            "metadata": kept,
            "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {}),
        }
    }


def pod_summary(body: Mapping[str, Any], namespace: str | None, labels: Mapping[str, str]) -> Any:
    """Small summaries (readiness, failure, the runtime's thermal report), not pod bodies."""
    key = key_of(namespace, labels)
    return {key: status.pod_summary(body)} if key else {}


# ----------------------------------------------------------------------------- status


def _observe(
    ctx: Context, body: Mapping[str, Any], indexes: Mapping[str, Any], deployment: Any = None
) -> Observation:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    pods = pods_of(indexes, key)
    if deployment is None:
        deployment = first(indexes.get("deployment_index"), key)
    try:
        plan = planned(ctx, body)
    except ValidationError as exc:  # the CRD should make this impossible; never crash-loop
        problem = render.Problem(reasons.INVALID_SPEC, str(exc)[:512])
        return Observation(deployment=None, pods=[], problems=[problem])
    return Observation(deployment, pods, plan.problems, plan.spec.desired_replicas(), plan.adaptive)


def refresh(ctx: Context, key: Key, indexes: Mapping[str, Any], logger: Any) -> None:
    """Recompute one object's status from the indexes; writes only if it changed. A rolling
    object takes a whole reconcile: what its pods and nodes show may move the rollout."""
    body = first(indexes.get("infd_index"), key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if (body.get("spec") or {}).get("rollout"):
        reconcile(ctx, body, indexes, "rollout", 0)
        return
    try:
        ctx.writer.write(body, _observe(ctx, body, indexes))
    except ApiException as exc:  # the next event writes it
        logger.warning("status of %s/%s not written: %s", key[0], key[1], exc.reason)


def refresh_due(ctx: Context, key: Key, first_mark: float) -> None:
    refresh(ctx, key, ctx.indexes, log)
    metrics.STATUS_LAG.observe(ctx.refreshes.clock() - first_mark)


# ----------------------------------------------------------------------------- reconcile


def _sync(ctx: Context, body: Mapping[str, Any], indexes: Mapping[str, Any]) -> str:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    try:
        plan = planned(ctx, body)
    except ValidationError:
        ctx.writer.write(body, _observe(ctx, body, indexes))  # reports InvalidSpec
        return "invalid"
    deployment = None
    if plan.problems:  # leave any running generation alone; status says why
        ctx.writer.write(body, _observe(ctx, body, indexes))
        return "problem"
    with ctx.owner_lock(key):
        deployment = apply_children(ctx, key, body, plan, indexes)
        if plan.spec.rollout is None:
            ctx.writer.write(body, _observe(ctx, body, indexes, deployment))
            return "ok"
        outcome = rollout_sync.step(ctx, body, plan.spec, indexes)
        obs = _observe(ctx, body, indexes, outcome.deployment)
        ctx.writer.write(body, dataclasses.replace(obs, rollout=outcome.status))
    if outcome.recheck_seconds is not None:  # a bake or a timeout ends then
        ctx.requeue.soon(key, outcome.recheck_seconds)
    return "ok"


def reconcile(
    ctx: Context, body: Mapping[str, Any], indexes: Mapping[str, Any], trigger: str, attempt: int
) -> None:
    """Children and status of one object. An API error schedules a retry with backoff
    (`requeue`); a request the API server refuses (a quota, a policy) also becomes the
    ApplyRejected condition, and is still retried: whoever lifts the quota expects recovery."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    started = time.monotonic()
    result = "error"
    try:
        ctx.requeue.clear(key)
        result = _sync(ctx, body, indexes)
    except ApiException as exc:
        if namespace_terminating(exc):
            ctx.requeue.clear(key)  # its namespace is being deleted, the object with it
            result = "gone"
            return
        delay = ctx.requeue.later(key, attempt)
        if exc.status in PERMANENT_STATUSES:  # e.g. a quota or a policy: a human must act
            detail = f"the API server refused a child: {exc.reason}: {(exc.body or '')[:400]}"
            problem = render.Problem(reasons.APPLY_REJECTED, detail)
            ctx.writer.write(body, Observation(deployment=None, pods=[], problems=[problem]))
            result = "rejected"
        log.warning(
            "%s/%s: API error %s %s, retry in %.0fs: %s",
            *key,
            exc.status,
            exc.reason,
            delay,
            (exc.body or "")[:300],
        )
    finally:
        metrics.RECONCILES.labels(trigger=trigger, result=result).inc()
        metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(time.monotonic() - started)


def retry(ctx: Context, key: Key, attempt: int) -> None:
    body = first(ctx.indexes.get("infd_index"), key)
    if body is not None and not body["metadata"].get("deletionTimestamp"):
        reconcile(ctx, body, ctx.indexes, "retry", attempt)


async def owner_changed(ctx: Context, event: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    """Level-triggered: every event of an object (the initial listing at start included) runs
    one reconcile, which writes only what differs. Why not Kopf's on.create/on.update/on.resume
    or a timer: those keep their state on the object — a finalizer, a last-handled copy of the
    spec, progress annotations — two to four writes per object and a finalizer that outlives
    an uninstalled operator; events cost no writes at all.

    Async, and a thread only for real work: most events are the echoes of the object's own
    status writes, and a settled object needs only a coalesced status refresh. Kopf queues
    each object's events until its handler returns, so a handler that waited for a thread per
    event let those queues (whole bodies) pile up at fleet scale."""
    key = (str(body["metadata"]["namespace"]), str(body["metadata"]["name"]))
    if event.get("type") == "DELETED":
        await asyncio.to_thread(_forget, ctx, body, key)
    elif body["metadata"].get("deletionTimestamp"):
        return
    elif settled(ctx, body, ctx.indexes):
        if not ctx.writer.is_echo(body):  # pods and Deployments mark their own changes
            ctx.refreshes.mark(key)
    else:
        # As asyncio.to_thread does, but on the reconcile pool: with the handler's context.
        context = contextvars.copy_context()
        await asyncio.get_running_loop().run_in_executor(
            ctx.reconciles, lambda: context.run(reconcile, ctx, body, ctx.indexes, "event", 0)
        )


def _forget(ctx: Context, body: Mapping[str, Any], key: Key) -> None:
    if (body.get("spec") or {}).get("rollout"):
        with contextlib.suppress(ApiException):  # a Node's request then stays: harmless
            rollout_sync.unstage(ctx, key)
    ctx.writer.forget(key)
    ctx.forget_owner(key)
    with contextlib.suppress(ValidationError):
        for ident in child_ids(key, planned(ctx, body)):
            ctx.applier.forget(ident)


# ----------------------------------------------------------------------------- pods and nodes


def _window(ctx: Context, key: Key) -> float | None:
    body = first(ctx.indexes.get("infd_index"), key)
    if body is None:
        return None
    try:
        return float(planned(ctx, body).spec.thermal.critical_for_seconds)
    except ValidationError:
        return None


def _reading(indexes: Mapping[str, Any], key: Key, pod: str) -> ThermalReading | None:
    """The replica's own thermal report, from the pod index, where the condition was parsed
    once for this event (Kopf updates indexes before handlers run)."""
    summary = next((p for p in pods_of(indexes, key) if p.get("pod") == pod), None)
    reading = (summary or {}).get("thermal")  # a ThermalReading, decoded by the index
    return reading if isinstance(reading, ThermalReading) else None


def pod_changed(ctx: Context, key: Key, event: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    """A replica changed (readiness, its thermal condition, deletion): refresh the owner's
    status, tell the hot-node queue where the critical replicas are, and drop the kubelet's
    warnings about a pod that has started. One handler for all three: Kopf's per-handler
    machinery costs more than what each does."""
    gone = event.get("type") == "DELETED" or bool(body["metadata"].get("deletionTimestamp"))
    ctx.writer.kubelet.pod_changed(key, body, gone)
    node = (body.get("spec") or {}).get("nodeName")
    if node:
        replica = Replica(key[0], body["metadata"]["name"], key[1], node)
        if gone:
            ctx.hot.forget_pod(replica)
            ctx.steps.forget(replica)
        else:
            reading = _reading(ctx.indexes, key, replica.pod)
            critical = reading is not None and reading.reason == REASON_CRITICAL
            ctx.hot.observe_pod(replica, critical, _window(ctx, key))
            ctx.steps.observe(replica, reading)  # an Event per step of the ladder
    ctx.refreshes.mark(key)


# ----------------------------------------------------------------------------- children


async def child_changed(
    ctx: Context, kind: str, key: Key, event: Mapping[str, Any], body: Mapping[str, Any]
) -> None:
    """Drift repair, from the child's own watch: a deleted child is re-created, a hand-edited
    one re-applied, an unwanted one (a PDB after scaling to one) deleted. Rollout progress and
    readiness counts live in the Deployment's status, so its events also refresh the owner's.
    Async: most events (status updates, our own writes coming back) need no thread at all."""
    gone = event.get("type") == "DELETED"
    if kind == "Deployment" or gone:  # a rolling object's step repairs its site children
        ctx.refreshes.mark(key)
    if not gone and child_unchanged(ctx, key, kind, body, ctx.indexes):
        return
    live = None if gone else dict(body)
    try:
        done = await asyncio.to_thread(correct_child, ctx, key, kind, live, ctx.indexes)
    except ApiException as exc:  # the owner's next event, or its retry, applies it
        if namespace_terminating(exc):
            return  # the owner goes with its namespace
        log.warning("could not correct %s of %s/%s: %s", kind, *key, exc.reason)
        ctx.requeue.later(key, 0)
        done = None
    except ValidationError:
        done = None  # the owner's own reconcile reports InvalidSpec
    if done:
        log.info("%s %s of %s/%s", done, kind, *key)


def kubelet_warned(ctx: Context, event: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    """A kubelet warning about one of Ember's pods that says something new: the owner's status
    is recomputed (and, on a new Degraded reason, one Event is posted)."""
    key = kubelet_events.record(ctx, event, body)
    if key is not None:
        refresh(ctx, key, ctx.indexes, kubelet_events.log)


def node_changed(ctx: Context, body: Mapping[str, Any], gone: bool) -> None:
    """A Node with a site changed what a rollout reads (Ready, its labels, a stage request):
    the rolling objects take a step. Heartbeats that change none of it cost a comparison."""
    name = str(body["metadata"]["name"])
    summary = None if gone else rollout_observe.node_summary(body)
    with ctx.lock:
        if ctx.nodes_seen.get(name) == summary:
            return
        ctx.nodes_seen[name] = summary
    owners = ctx.indexes.get("infd_index") or {}
    for key in list(owners):
        body_ = first(owners, key)
        if body_ is not None and (body_.get("spec") or {}).get("rollout"):
            ctx.refreshes.mark(key)
