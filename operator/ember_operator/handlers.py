"""Kopf wiring only: which events call what. Small, idempotent, sync handlers (Kopf runs them in
its thread pool) except where noted.

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
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from ember_runtime.contract.thermal import REASON_CRITICAL
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import kopf_json, kubelet_events, metrics, render, status
from ember_operator.api import GROUP, PLURAL, VERSION
from ember_operator.apply import DIGEST_ANNOTATION, Applier, api_client, namespace_terminating
from ember_operator.reconcile import (
    CHILD_LABELS,
    Context,
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
from ember_operator.settings import load_settings
from ember_operator.status_writer import Observation, StatusWriter
from ember_operator.thermal.nodes import HotNodes, Replica

RESOURCE = (GROUP, VERSION, PLURAL)
log = logging.getLogger(__name__)
SETTINGS = load_settings()
INDEXES = (
    "infd_index",
    "configmap_index",
    "service_index",
    "deployment_index",
    "pdb_index",
    "pod_index",
)
# API errors that need a human (quota, policy, a malformed child): reported, retried slowly.
PERMANENT_STATUSES = frozenset({400, 403, 422})


class QuietSuccess(logging.Filter):
    """Drops Kopf's "Handler '…' succeeded." lines: event handlers run on every watch event
    (a line per pod status change across the fleet). Failures, retries and everything our own
    code logs (each child applied, each repair) still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (message.startswith("Handler '") and message.endswith("' succeeded."))


logging.getLogger("kopf.objects").addFilter(QuietSuccess())
kopf_json.install()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kopf's own login, not the client library's: that one reads $KUBECONFIG only at import."""
    info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs)
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is not None and host and port:
        # Like client-go's in-cluster config: the env vars, not the kubernetes.default.svc name
        # Kopf assumes, so clusters without cluster DNS (common on edge boxes) work too.
        info = dataclasses.replace(info, server=f"https://{_host(host)}:{port}")
    return info or kopf.login_with_kubeconfig(**kwargs)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in URLs


class NoDiffBase(kopf.DiffBaseStorage):
    """Kopf's diff base for change-detecting handlers (on.create/update/resume, timers,
    daemons), of which Ember registers none: every handler here is `on.event` or an index.
    Kopf still builds the "essence" of every event's body (a deep copy, managedFields and all)
    and diffs it; at fleet scale that copying was a tenth of the operator's CPU. Empty
    essences on both sides make the diff empty, and nothing is stored on the objects.
    `test_handlers.py` fails if Ember ever registers a change-detecting handler, and
    `configure` keeps Kopf's own storage in a process that has one."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return kopf.BodyEssence()  # not None ("never handled"): the diff is then empty too

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def _has_change_handlers(registry: kopf.OperatorRegistry) -> bool:
    """Whether anything in this process needs Kopf's diffs: not Ember's own handlers, but a
    process that loads other handlers beside them (the test suite runs a toy operator with an
    on.create in the same process) must keep Kopf's storage. Kopf has no public accessor."""
    return bool(
        list(registry._changing.get_all_handlers()) or list(registry._spawning.get_all_handlers())
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Kopf would post an Event for every handler success; only warnings are worth a write.
    settings.posting.level = logging.WARNING
    # Re-open watches before idle load balancers silently drop them (kopf docs, "Configuration").
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 12
    if not _has_change_handlers(kopf.get_default_registry()):
        settings.persistence.diffbase_storage = NoDiffBase()
    api = api_client()
    memo.ctx = Context(
        api=api,
        applier=Applier(api, SETTINGS.api_timeout_seconds),
        settings=SETTINGS,
        writer=StatusWriter(api, SETTINGS.api_timeout_seconds),
        hot=HotNodes(client.CoreV1Api(api)),
    )


@kopf.on.startup()
async def start_hot_nodes(memo: kopf.Memo, **_: Any) -> None:
    """Runs after `configure` (Kopf keeps declaration order): adopt nodes already tainted hot,
    then serve the one queue of delayed actions."""
    hot: HotNodes = memo.ctx.hot
    await asyncio.to_thread(hot.adopt_tainted)
    memo.hot_task = asyncio.create_task(hot.run(), name="ember-hot-nodes")


@kopf.on.startup()
async def start_retries(memo: kopf.Memo, **_: Any) -> None:
    ctx: Context = memo.ctx
    memo.retry_task = asyncio.create_task(
        ctx.requeue.run(lambda key, attempt: _retry(ctx, key, attempt)), name="ember-retries"
    )
    memo.refresh_task = asyncio.create_task(
        ctx.refreshes.run(lambda key, first: _refresh_due(ctx, key, first)),
        name="ember-status-refresh",
    )


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    for name in ("hot_task", "retry_task", "refresh_task"):
        task = memo.get(name)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    ctx = memo.get("ctx")
    if ctx is not None:
        ctx.reconciles.shutdown(wait=False, cancel_futures=True)
        ctx.api.close()


@kopf.on.probe(id="reconciles")
def probe_reconciles(**_: Any) -> float:
    return sum(
        s.value
        for m in metrics.RECONCILES.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


# ----------------------------------------------------------------------------- indexes
# Async, though they never await: Kopf runs a sync handler in its thread pool (a submit, a
# shielded future, a context copy), and every watch event of every child and pod passes
# through an index; these are a few dict lookups, cheaper than the hop.


def _small(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the owner's reconcile and status need of a child: its identity, versions, spec
    digest and status. Not its spec (a Deployment's pod template is most of its size): drift
    is judged on the child's own events, which carry the whole body."""
    meta = body["metadata"]
    kept = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "resourceVersion")}
    digest = (meta.get("annotations") or {}).get(DIGEST_ANNOTATION)
    kept["annotations"] = {DIGEST_ANNOTATION: digest} if digest else {}
    return {"metadata": kept, "status": body.get("status") or {}}


def _index_child(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
    key = key_of(namespace, labels)
    return {key: _small(body)} if key else {}


@kopf.index(*RESOURCE)
async def infd_index(body: kopf.Body, namespace: str | None, name: str | None, **_: Any) -> Any:
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


@kopf.index("v1", "configmaps", labels=CHILD_LABELS)
async def configmap_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("v1", "services", labels=CHILD_LABELS)
async def service_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def pdb_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("v1", "pods", labels=CHILD_LABELS)
async def pod_index(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
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
        problem = render.Problem("InvalidSpec", str(exc)[:512])
        return Observation(deployment=None, pods=[], problems=[problem])
    thermal = status.thermal_of(pods, plan.adaptive, plan.spec.engine.max_batch_size)
    return Observation(deployment, pods, plan.problems, plan.spec.replicas, thermal)


def refresh(ctx: Context, key: tuple[str, str], indexes: Mapping[str, Any], logger: Any) -> None:
    """Recompute one object's status from the indexes; writes only if it changed."""
    body = first(indexes.get("infd_index"), key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        ctx.writer.write(body, _observe(ctx, body, indexes))
    except ApiException as exc:  # the next event writes it
        logger.warning("status of %s/%s not written: %s", key[0], key[1], exc.reason)


def _remember_indexes(ctx: Context, kwargs: Mapping[str, Any]) -> None:
    if not ctx.indexes:  # Kopf's indexes are live views: delayed work reads them later
        ctx.indexes = {name: kwargs[name] for name in INDEXES}


def _refresh_due(ctx: Context, key: tuple[str, str], first_mark: float) -> None:
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
    if not plan.problems:  # else leave any running generation alone; status says why
        with ctx.owner_lock(key):
            deployment = apply_children(ctx, key, body, plan, indexes)
    ctx.writer.write(body, _observe(ctx, body, indexes, deployment))
    return "problem" if plan.problems else "ok"


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
        result = _sync(ctx, body, indexes)
        ctx.requeue.clear(key)
    except ApiException as exc:
        if namespace_terminating(exc):
            ctx.requeue.clear(key)  # its namespace is being deleted, the object with it
            result = "gone"
            return
        delay = ctx.requeue.later(key, attempt)
        if exc.status in PERMANENT_STATUSES:  # e.g. a quota or a policy: a human must act
            detail = f"the API server refused a child: {exc.reason}: {(exc.body or '')[:400]}"
            problem = render.Problem("ApplyRejected", detail)
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


def _retry(ctx: Context, key: tuple[str, str], attempt: int) -> None:
    body = first(ctx.indexes.get("infd_index"), key)
    if body is not None and not body["metadata"].get("deletionTimestamp"):
        reconcile(ctx, body, ctx.indexes, "retry", attempt)


@kopf.on.event(*RESOURCE)
async def infd_event(**kwargs: Any) -> None:
    """Level-triggered: every event of an object (the initial listing at start included) runs
    one reconcile, which writes only what differs. Why not Kopf's on.create/on.update/on.resume
    or a timer: those keep their state on the object — a finalizer, a last-handled copy of the
    spec, progress annotations — two to four writes per object and a finalizer that outlives
    an uninstalled operator; events cost no writes at all.

    Async, and a thread only for real work: most events are the echoes of the object's own
    status writes, and a settled object needs only a coalesced status refresh. Kopf queues
    each object's events until its handler returns, so a handler that waited for a thread per
    event let those queues (whole bodies) pile up at fleet scale."""
    ctx: Context = kwargs["memo"].ctx
    _remember_indexes(ctx, kwargs)
    body = kwargs["body"]
    key = (str(kwargs["namespace"]), str(kwargs["name"]))
    if kwargs["event"].get("type") == "DELETED":
        await asyncio.to_thread(_forget, ctx, body, key)
    elif body["metadata"].get("deletionTimestamp"):
        return
    elif settled(ctx, body, kwargs):
        if not ctx.writer.is_echo(body):  # pods and Deployments mark their own changes
            ctx.refreshes.mark(key)
    else:
        # As asyncio.to_thread does, but on the reconcile pool: with the handler's context.
        context = contextvars.copy_context()
        await asyncio.get_running_loop().run_in_executor(
            ctx.reconciles, lambda: context.run(reconcile, ctx, body, kwargs, "event", 0)
        )


def _forget(ctx: Context, body: Mapping[str, Any], key: tuple[str, str]) -> None:
    ctx.writer.forget(key)
    ctx.forget_owner(key)
    with contextlib.suppress(ValidationError):
        for ident in child_ids(key, planned(ctx, body)):
            ctx.applier.forget(ident)


# ----------------------------------------------------------------------------- pods and nodes


def _window(ctx: Context, indexes: Mapping[str, Any], key: tuple[str, str]) -> float | None:
    body = first(indexes.get("infd_index"), key)
    if body is None:
        return None
    try:
        return float(planned(ctx, body).spec.thermal.critical_for_seconds)
    except ValidationError:
        return None


def _critical(indexes: Mapping[str, Any], key: tuple[str, str], pod: str) -> bool:
    """The replica's own thermal report says Critical: read from the pod index, where the
    condition was parsed once for this event (Kopf updates indexes before handlers run)."""
    summary = next((p for p in pods_of(indexes, key) if p.get("pod") == pod), None)
    reading = (summary or {}).get("thermal")  # a ThermalReading, decoded by the index
    return reading is not None and reading.reason == REASON_CRITICAL


@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def pod_event(**kwargs: Any) -> None:
    """A replica changed (readiness, its thermal condition, deletion): refresh the owner's
    status, tell the hot-node queue where the critical replicas are, and drop the kubelet's
    warnings about a pod that has started. One handler for all three: Kopf's per-handler
    machinery costs more than what each does."""
    key = key_of(kwargs.get("namespace"), kwargs.get("labels") or {})
    if key is None:
        return
    ctx: Context = kwargs["memo"].ctx
    body = kwargs["body"]
    gone = kwargs["event"].get("type") == "DELETED" or bool(
        body["metadata"].get("deletionTimestamp")
    )
    ctx.writer.kubelet.pod_changed(key, body, gone)
    node = (body.get("spec") or {}).get("nodeName")
    if node:
        replica = Replica(key[0], body["metadata"]["name"], key[1], node)
        if gone:
            ctx.hot.forget_pod(replica)
        else:
            ctx.hot.observe_pod(
                replica, _critical(kwargs, key, replica.pod), _window(ctx, kwargs, key)
            )
    _remember_indexes(ctx, kwargs)
    ctx.refreshes.mark(key)


# ----------------------------------------------------------------------------- children


async def _on_child_event(kind: str, kwargs: Mapping[str, Any]) -> None:
    """Drift repair, from the child's own watch: a deleted child is re-created, a hand-edited
    one re-applied, an unwanted one (a PDB after scaling to one) deleted. Rollout progress and
    readiness counts live in the Deployment's status, so its events also refresh the owner's.
    Async: most events (status updates, our own writes coming back) need no thread at all."""
    key = key_of(kwargs.get("namespace"), kwargs.get("labels") or {})
    if key is None:
        return
    ctx: Context = kwargs["memo"].ctx
    _remember_indexes(ctx, kwargs)
    gone = kwargs["event"].get("type") == "DELETED"
    if kind == "Deployment" and not gone:
        ctx.refreshes.mark(key)
    if not gone and child_unchanged(ctx, key, kind, kwargs["body"], ctx.indexes):
        return
    body = None if gone else dict(kwargs["body"])
    try:
        done = await asyncio.to_thread(correct_child, ctx, key, kind, body, ctx.indexes)
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


@kopf.on.event("v1", "configmaps", labels=CHILD_LABELS)
async def configmap_event(**kwargs: Any) -> None:
    await _on_child_event("ConfigMap", kwargs)


@kopf.on.event("v1", "services", labels=CHILD_LABELS)
async def service_event(**kwargs: Any) -> None:
    await _on_child_event("Service", kwargs)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_event(**kwargs: Any) -> None:
    await _on_child_event("Deployment", kwargs)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def pdb_event(**kwargs: Any) -> None:
    await _on_child_event("PodDisruptionBudget", kwargs)


# ----------------------------------------------------------------------------- kubelet Events


@kopf.on.startup()
def watch_pod_warnings_only(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.watching.field_selectors[kubelet_events.EVENTS] = kubelet_events.FIELD_SELECTOR


@kopf.on.event(*kubelet_events.EVENTS)
def kubelet_event(**kwargs: Any) -> None:
    """A kubelet warning about one of Ember's pods that says something new: the owner's status
    is recomputed (and, on a new Degraded reason, one Event is posted)."""
    ctx: Context = kwargs["memo"].ctx
    key = kubelet_events.record(ctx, kwargs)
    if key is not None:
        refresh(ctx, key, kwargs, kubelet_events.log)
