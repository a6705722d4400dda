"""Kopf wiring only: which events call what. Small, idempotent, sync handlers (Kopf runs them in
its thread pool) except where noted.

- InferenceDeployment create/update/resume and a slow resync timer → `reconcile` (children) →
  `status_writer` (status).
- One watch over Ember's pods (an index of small summaries + an event handler) → the owner's
  status, on change only, and the hot-node queue (`thermal.nodes`).
- Deployments' events → status (rollout progress) and repair of deleted children.
- The hot-node queue (`thermal.nodes`) re-reads only the nodes it tainted and releases each once
  the node agent's `ember.dev/Thermal` condition says it has cooled.

The operator never calls a runtime: no network path to pods, no API-key Secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf
from ember_runtime.config import REASON_CRITICAL, parse_thermal_condition
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import metrics, render, status
from ember_operator.api import GROUP, PLURAL, VERSION
from ember_operator.apply import Applier, api_client
from ember_operator.reconcile import (
    CHILD_LABELS,
    Context,
    apply_children,
    first,
    key_of,
    planned,
    pods_of,
    repair,
)
from ember_operator.settings import load_settings
from ember_operator.status_writer import Observation, StatusWriter
from ember_operator.thermal.nodes import HotNodes, Replica

RESOURCE = (GROUP, VERSION, PLURAL)
# Read once at import: Kopf needs the timer interval when the decorator runs.
SETTINGS = load_settings()
# API errors a retry cannot fix (the request itself is wrong); everything else backs off.
PERMANENT_STATUSES = frozenset({400, 403, 422})


class QuietTimerSuccess(logging.Filter):
    """Drops Kopf's "Timer '…' succeeded." lines: the resync timer would log one per object
    per period. Failures, retries and everything our handlers log still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (message.startswith("Timer '") and message.endswith("' succeeded."))


logging.getLogger("kopf.objects").addFilter(QuietTimerSuccess())


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


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base go to annotations under our prefix: the structural schema would
    # prune anything Kopf wrote into status, and status is the status writer's alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Kopf would post an Event for every handler success; only warnings are worth a write.
    settings.posting.level = logging.WARNING
    # Re-open watches before idle load balancers silently drop them (kopf docs, "Configuration").
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 12
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


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("hot_task")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    ctx = memo.get("ctx")
    if ctx is not None:
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


def _strip(body: Mapping[str, Any]) -> dict[str, Any]:
    """Drop managedFields: a third of a child's size, never compared."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**{k: v for k, v in body.items() if k != "metadata"}, "metadata": meta}


def _index_child(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
    key = key_of(namespace, labels)
    return {key: _strip(body)} if key else {}


@kopf.index(*RESOURCE)
def infd_index(body: kopf.Body, namespace: str | None, name: str | None, **_: Any) -> Any:
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
def configmap_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("v1", "services", labels=CHILD_LABELS)
def service_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
def deployment_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
def pdb_index(**kwargs: Any) -> Any:
    return _index_child(**kwargs)


@kopf.index("v1", "pods", labels=CHILD_LABELS)
def pod_index(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
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
    except ApiException as exc:  # the next event or the resync writes it
        logger.warning("status of %s/%s not written: %s", key[0], key[1], exc.reason)


# ----------------------------------------------------------------------------- reconcile


def _backoff(retry: int) -> float:
    return float(min(300, 5 * 2 ** min(retry, 6)))


def _sync(ctx: Context, body: kopf.Body, indexes: Mapping[str, Any]) -> str:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    try:
        plan = planned(ctx, body)
    except ValidationError:
        ctx.writer.write(body, _observe(ctx, body, indexes))  # reports InvalidSpec
        return "invalid"
    deployment = None
    if not plan.problems:  # else leave any running generation alone; status says why
        deployment = apply_children(ctx, key, plan.manifests, indexes)
    ctx.writer.write(body, _observe(ctx, body, indexes, deployment))
    return "problem" if plan.problems else "ok"


def _handle(trigger: str, kwargs: Mapping[str, Any]) -> None:
    ctx: Context = kwargs["memo"].ctx
    body = kwargs["body"]
    started = time.monotonic()
    result = "error"
    try:
        result = _sync(ctx, body, kwargs)
    except ApiException as exc:
        if exc.status in PERMANENT_STATUSES:
            detail = f"the API server refused a child: {exc.reason}: {(exc.body or '')[:400]}"
            problem = render.Problem("ApplyRejected", detail)
            ctx.writer.write(body, Observation(deployment=None, pods=[], problems=[problem]))
            raise kopf.PermanentError(f"child rejected ({exc.status}): {exc.reason}") from exc
        delay = _backoff(int(kwargs.get("retry") or 0))
        raise kopf.TemporaryError(f"API error {exc.status}: {exc.reason}", delay=delay) from exc
    finally:
        metrics.RECONCILES.labels(trigger=trigger, result=result).inc()
        metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(time.monotonic() - started)


@kopf.on.resume(*RESOURCE)
def on_resume(**kwargs: Any) -> None:
    _handle("resume", kwargs)


@kopf.on.create(*RESOURCE)
def on_create(**kwargs: Any) -> None:
    _handle("create", kwargs)


@kopf.on.update(*RESOURCE, field="spec")
def on_update(**kwargs: Any) -> None:
    _handle("update", kwargs)


@kopf.timer(*RESOURCE, interval=SETTINGS.resync_seconds, initial_delay=SETTINGS.resync_seconds)
def resync(**kwargs: Any) -> None:
    """Repair drift the watches cannot see; observed state itself arrives through the watches."""
    if kwargs["meta"].get("deletionTimestamp"):
        return
    try:
        _handle("timer", kwargs)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        kwargs["logger"].warning("resync failed, next try in %ss: %s", SETTINGS.resync_seconds, exc)


@kopf.on.delete(*RESOURCE, optional=True)
def forget(namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if ctx is not None:
        ctx.writer.forget((str(namespace), str(name)))


# ----------------------------------------------------------------------------- pods and nodes


def _window(ctx: Context, indexes: Mapping[str, Any], key: tuple[str, str]) -> float | None:
    body = first(indexes.get("infd_index"), key)
    if body is None:
        return None
    try:
        return float(planned(ctx, body).spec.thermal.critical_for_seconds)
    except ValidationError:
        return None


@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
def pod_event(**kwargs: Any) -> None:
    """A replica changed (readiness, its thermal condition, deletion): refresh the owner's
    status and tell the hot-node queue where the critical replicas are."""
    key = key_of(kwargs.get("namespace"), kwargs.get("labels") or {})
    if key is None:
        return
    ctx: Context = kwargs["memo"].ctx
    body = kwargs["body"]
    node = (body.get("spec") or {}).get("nodeName")
    if node:
        replica = Replica(key[0], body["metadata"]["name"], key[1], node)
        gone = kwargs["event"].get("type") == "DELETED" or body["metadata"].get("deletionTimestamp")
        if gone:
            ctx.hot.forget_pod(replica)
        else:
            reading = parse_thermal_condition((body.get("status") or {}).get("conditions"))
            critical = reading is not None and reading.reason == REASON_CRITICAL
            ctx.hot.observe_pod(replica, critical, _window(ctx, kwargs, key))
    refresh(ctx, key, kwargs, kwargs["logger"])


# ----------------------------------------------------------------------------- children


def _on_child_event(kind: str, kwargs: Mapping[str, Any]) -> None:
    key = key_of(kwargs.get("namespace"), kwargs.get("labels") or {})
    if key is None:
        return
    ctx: Context = kwargs["memo"].ctx
    if kwargs["event"].get("type") != "DELETED":
        if kind == "Deployment":  # rollout progress and readiness counts live in its status
            refresh(ctx, key, kwargs, kwargs["logger"])
        return
    try:
        repair(ctx, key[0], key[1], kind, kwargs["logger"])
    except ApiException as exc:  # the resync timer will repair it later
        kwargs["logger"].warning("could not re-create %s for %s: %s", kind, key, exc.reason)


@kopf.on.event("v1", "configmaps", labels=CHILD_LABELS)
def configmap_event(**kwargs: Any) -> None:
    _on_child_event("ConfigMap", kwargs)


@kopf.on.event("v1", "services", labels=CHILD_LABELS)
def service_event(**kwargs: Any) -> None:
    _on_child_event("Service", kwargs)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
def deployment_event(**kwargs: Any) -> None:
    _on_child_event("Deployment", kwargs)


# Last: it registers the kubelet-Event handlers and uses `refresh` above.
from ember_operator import kubelet_events  # noqa: E402, F401
