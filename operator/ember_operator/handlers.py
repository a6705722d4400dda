"""Kopf handlers: small, idempotent, sync (Kopf runs them in its thread pool).

One function, `sync`, does the whole reconcile (parse → size → render → apply what differs →
status). It is called on create/update/resume and from a timer that re-reads observed state; the
children and pods are known from Kopf indexes (in-memory, fed by watches), so a steady-state
reconcile reads nothing from the API server and writes nothing to it.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import kopf
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import metrics, render, sizing, status
from ember_operator.api import GROUP, PLURAL, VERSION
from ember_operator.api.models import InferenceDeploymentSpec, parse_spec
from ember_operator.apply import Applier, api_client, get_object
from ember_operator.settings import MANAGED_BY, OperatorSettings, load_settings
from ember_operator.thermal.actions import ObjectRef
from ember_operator.thermal.loop import ThermalLoop, ThermalReport, throttled_condition
from ember_operator.thermal.policy import ThermalLimits
from ember_operator.thermal.poller import replicas_from_pods

RESOURCE = (GROUP, VERSION, PLURAL)
CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}
# Read once at import: Kopf needs the timer interval when the decorator runs.
SETTINGS = load_settings()
# API errors a retry cannot fix (the request itself is wrong); everything else backs off.
PERMANENT_STATUSES = frozenset({400, 403, 422})
RENDER_CACHE_SIZE = 4096
# The thermal loop's period: the issue asks for a new batch size within 2 s of a crossing.
THERMAL_SECONDS = 1.0
# API keys are re-read this often, so a rotated Secret reaches the poller without a restart.
API_KEY_TTL_SECONDS = 300.0


class QuietTimerSuccess(logging.Filter):
    """Drops Kopf's "Timer '…' succeeded." lines: the thermal timer would log one per object
    per second. Failures, retries and everything our handlers log still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (message.startswith("Timer '") and message.endswith("' succeeded."))


logging.getLogger("kopf.objects").addFilter(QuietTimerSuccess())


@dataclass
class Context:
    api: ApiClient
    applier: Applier
    settings: OperatorSettings
    renders: OrderedDict[tuple[str, int], Plan] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The latest thermal tick per (namespace, name): both timers compute status from it, so the
    # thermal timer and the resync timer always agree and never undo each other's writes.
    thermal: dict[tuple[str, str], status.Thermal] = field(default_factory=dict)
    # (namespace, secret, key) -> (API key, monotonic time read)
    api_keys: dict[tuple[str, str, str], tuple[str | None, float]] = field(default_factory=dict)


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
    # prune anything Kopf wrote into status, and status is ours alone.
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
        api=api, applier=Applier(api, SETTINGS.api_timeout_seconds), settings=SETTINGS
    )


@kopf.on.startup()
async def start_thermal(memo: kopf.Memo, **_: Any) -> None:
    """Runs after `configure` (Kopf keeps declaration order); adopts nodes already tainted hot."""
    memo.thermal = ThermalLoop(client.CoreV1Api(memo.ctx.api))
    await memo.thermal.start()


@kopf.on.cleanup()
async def close_thermal(memo: kopf.Memo, **_: Any) -> None:
    loop = memo.get("thermal")
    if loop is not None:
        await loop.close()


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
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


def _key(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str] | None:
    owner = labels.get(render.INSTANCE_LABEL)
    return (str(namespace), owner) if owner else None


def _index_child(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
    key = _key(namespace, labels)
    return {key: _strip(body)} if key else {}


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


def _pod_source(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod the thermal poller needs (`replicas_from_pods`), and no more."""
    meta, spec, st = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return {
        "metadata": {k: meta.get(k) for k in ("name", "deletionTimestamp")},
        "spec": {"nodeName": spec.get("nodeName")},
        "status": {"podIP": st.get("podIP"), "conditions": st.get("conditions") or []},
    }


@kopf.index("v1", "pods", labels=CHILD_LABELS)
def pod_index(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
    key = _key(namespace, labels)
    return {key: {**status.pod_summary(body), "source": _pod_source(body)}} if key else {}


INDEX_BY_KIND = {
    "ConfigMap": "configmap_index",
    "Service": "service_index",
    "Deployment": "deployment_index",
    "PodDisruptionBudget": "pdb_index",
}


def _first(index: Any, key: tuple[str, str]) -> Mapping[str, Any] | None:
    if index is None or key not in index:
        return None
    return next(iter(index[key]), None)


# ----------------------------------------------------------------------------- reconcile


class Plan(NamedTuple):
    spec: InferenceDeploymentSpec
    sized: sizing.Sizing
    manifests: list[dict[str, Any]]
    problems: list[render.Problem]


def _planned(ctx: Context, body: Mapping[str, Any]) -> Plan:
    """Everything derived from the spec, cached per (uid, generation): rendering is the hot path
    of the resync timer, and a generation's spec never changes."""
    meta = body["metadata"]
    key = (meta["uid"], int(meta.get("generation", 0)))
    with ctx.lock:
        if key in ctx.renders:
            ctx.renders.move_to_end(key)
            return ctx.renders[key]
    spec = parse_spec(body["spec"])
    sized = sizing.compute(spec, ctx.settings, sizing.find_gguf_shape(spec, ctx.settings))
    owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
    plan = Plan(
        spec, sized, render.render(owner, spec, ctx.settings, sized), render.problems(spec, sized)
    )
    with ctx.lock:
        ctx.renders[key] = plan
        while len(ctx.renders) > RENDER_CACHE_SIZE:
            ctx.renders.popitem(last=False)
    return plan


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _apply_children(
    ctx: Context, key: tuple[str, str], manifests: list[dict[str, Any]], indexes: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """Write what differs from the indexed live children; return the Deployment as it is now."""
    live = {kind: _first(indexes.get(idx), key) for kind, idx in INDEX_BY_KIND.items()}
    written = ctx.applier.ensure(manifests, live)
    wanted = {m["kind"] for m in manifests}
    for kind, obj in live.items():
        if obj is not None and kind not in wanted:  # e.g. the PDB after scaling to one
            ctx.applier.delete(kind, key[0], obj["metadata"]["name"])
    return written.get("Deployment") or live.get("Deployment")


def sync(ctx: Context, *, body: kopf.Body, patch: kopf.Patch, indexes: Mapping[str, Any]) -> str:
    """Converge one InferenceDeployment, writing only what differs; returns the result label."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    try:
        plan = _planned(ctx, body)
    except ValidationError as exc:  # the CRD should make this impossible; never crash-loop
        problem = render.Problem("InvalidSpec", str(exc)[:512])
        _set_status(body=body, patch=patch, deployment=None, pods=[], problems=[problem])
        return "invalid"
    if plan.problems:  # leave any running generation alone; say why the new one can't roll
        deployment = _first(indexes.get("deployment_index"), key)
    else:
        deployment = _apply_children(ctx, key, plan.manifests, indexes)
    pod_index = indexes["pod_index"]
    pods = list(pod_index[key]) if key in pod_index else []
    _set_status(
        body=body,
        patch=patch,
        deployment=deployment,
        pods=pods,
        problems=plan.problems,
        desired=plan.spec.replicas,
        thermal=ctx.thermal.get(key) or _first_thermal(body, plan.spec),
    )
    return "problem" if plan.problems else "ok"


def _set_status(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    deployment: Mapping[str, Any] | None,
    pods: list[Mapping[str, Any]],
    problems: list[render.Problem],
    desired: int = 0,
    thermal: status.Thermal | None = None,
    announce: bool = True,
) -> None:
    """Put only the changed status fields into Kopf's patch: an empty patch is no write."""
    meta = body["metadata"]
    old = dict(body.get("status") or {})
    obs = status.Observed(
        generation=int(meta.get("generation", 0)),
        desired=desired,
        deployment=deployment,
        pods=pods,
        problems=problems,
        selector=render.selector_string(meta["name"]),
        thermal=thermal,
    )
    new = status.compute_status(obs, old, _now())
    for name, value in status.changed_fields(new, old).items():
        patch.status[name] = value
    conds = {c["type"]: c for c in new["conditions"]}
    metrics.record_conditions(
        (meta["namespace"], meta["name"]), {t: c["status"] for t, c in conds.items()}
    )
    if announce:
        _announce_degraded(body, conds[status.DEGRADED], old.get("conditions") or [])


def _announce_degraded(
    body: kopf.Body, degraded: Mapping[str, Any], old: list[Mapping[str, Any]]
) -> None:
    """One Warning Event per new Degraded reason, not one per resync."""
    if degraded["status"] != "True":
        return
    before = next((c for c in old if c.get("type") == status.DEGRADED), {})
    if before.get("status") == "True" and before.get("reason") == degraded["reason"]:
        return
    kopf.warn(body, reason=degraded["reason"], message=degraded["message"])


def _backoff(retry: int) -> float:
    return float(min(300, 5 * 2 ** min(retry, 6)))


def _handle(trigger: str, kwargs: Mapping[str, Any]) -> None:
    ctx: Context = kwargs["memo"].ctx
    body, patch = kwargs["body"], kwargs["patch"]
    started = time.monotonic()
    result = "error"
    try:
        result = sync(ctx, body=body, patch=patch, indexes=kwargs)
    except ApiException as exc:
        if exc.status in PERMANENT_STATUSES:
            detail = f"the API server refused a child: {exc.reason}: {(exc.body or '')[:400]}"
            problem = render.Problem("ApplyRejected", detail)
            _set_status(body=body, patch=patch, deployment=None, pods=[], problems=[problem])
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
    """Re-read observed state (pods, readiness) and repair drift; the interval is the backoff."""
    if kwargs["meta"].get("deletionTimestamp"):
        return
    try:
        _handle("timer", kwargs)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        kwargs["logger"].warning("resync failed, next try in %ss: %s", SETTINGS.resync_seconds, exc)


@kopf.on.delete(*RESOURCE, optional=True)
def forget(namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any) -> None:
    metrics.record_conditions((str(namespace), str(name)), None)
    ctx = memo.get("ctx")
    if ctx is not None:
        ctx.thermal.pop((str(namespace), str(name)), None)


# ----------------------------------------------------------------------------- thermal


def _api_key(
    ctx: Context, namespace: str, spec: InferenceDeploymentSpec, logger: Any
) -> str | None:
    """The key the runtime demands (needs `secrets get`); cached, re-read every few minutes."""
    ref = spec.server.api_key_secret_ref
    if ref is None:
        return None
    cache_key = (namespace, ref.name, ref.key)
    cached = ctx.api_keys.get(cache_key)
    if cached is not None and time.monotonic() - cached[1] < API_KEY_TTL_SECONDS:
        return cached[0]
    try:
        secret: Any = client.CoreV1Api(ctx.api).read_namespaced_secret(ref.name, namespace)
        raw = (secret.data or {}).get(ref.key)
        value = base64.b64decode(raw).decode().strip() if raw else None
    except ApiException as exc:  # the replicas will answer 401; status keeps the last values
        logger.warning("cannot read API key %s/%s: %s", namespace, ref.name, exc.reason)
        value = None
    ctx.api_keys[cache_key] = (value, time.monotonic())
    return value


def _first_thermal(body: kopf.Body, spec: InferenceDeploymentSpec) -> status.Thermal | None:
    """Before the first tick: the Throttled condition a tick over no readings would give, so the
    reconcile's first status already holds it and the thermal timer has nothing to add. Once
    status has one (e.g. after a restart), None keeps it until a real tick says otherwise."""
    conditions = (body.get("status") or {}).get("conditions") or []
    if any(c.get("type") == status.THROTTLED for c in conditions):
        return None
    try:
        limits = ThermalLimits.from_spec(spec)
    except ValueError:
        return None
    return status.Thermal({}, None, throttled_condition([], limits))


async def _thermal_report(
    memo: kopf.Memo, body: kopf.Body, plan: Plan, pods: list[Mapping[str, Any]], logger: Any
) -> status.Thermal:
    limits = ThermalLimits.from_spec(plan.spec)
    if not limits.adaptive:  # policy off: say so, touch no replica
        return status.Thermal({}, None, throttled_condition([], limits))
    meta = body["metadata"]
    api_key = await asyncio.to_thread(_api_key, memo.ctx, meta["namespace"], plan.spec, logger)
    replicas = replicas_from_pods([p["source"] for p in pods], plan.spec.server.port, api_key)
    owner = ObjectRef(
        f"{GROUP}/{VERSION}", "InferenceDeployment", meta["name"], meta["namespace"], meta["uid"]
    )
    report: ThermalReport = await memo.thermal.tick(owner, limits, replicas)
    for action in report.actions:
        logger.info("thermal: %s", action)
    hottest = None if report.hottest_celsius is None else round(report.hottest_celsius)
    return status.Thermal(report.replica_fields(), hottest, report.throttled)


@kopf.timer(*RESOURCE, interval=THERMAL_SECONDS, id="thermal")
async def thermal_tick(
    memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, logger: Any, **kwargs: Any
) -> None:
    """Poll replicas, push batch sizes, vacate hot nodes; status through the same computation
    as `sync`, so in steady state this writes nothing."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    if (body.get("status") or {}).get("observedGeneration") != meta.get("generation"):
        return  # a generation's first status (and its Degraded Event) is the reconcile's to write
    ctx: Context = memo.ctx
    key = (meta["namespace"], meta["name"])
    try:
        plan = await asyncio.to_thread(_planned, ctx, body)
    except ValidationError:
        return  # `sync` reports it as InvalidSpec
    pod_index = kwargs["pod_index"]
    pods = list(pod_index[key]) if key in pod_index else []
    try:
        ctx.thermal[key] = await _thermal_report(memo, body, plan, pods, logger)
    except ValueError as exc:  # limits the CRD could not rule out (e.g. minBatch > maxBatch)
        logger.warning("thermal loop skipped: %s", exc)
        return
    _set_status(
        body=body,
        patch=patch,
        deployment=_first(kwargs.get("deployment_index"), key),
        pods=pods,
        problems=plan.problems,
        desired=plan.spec.replicas,
        thermal=ctx.thermal[key],
        # Degraded's Event is the reconcile's to post: this timer runs beside the resync timer and
        # may see the status from before the reconcile's patch, so it would post a duplicate.
        announce=False,
    )


# ----------------------------------------------------------------------------- child repair


def repair(ctx: Context, namespace: str, owner: str, kind: str, logger: Any) -> None:
    """A child was deleted: re-apply it now instead of waiting for the next resync."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{owner}"
    body = get_object(ctx.api, path, ctx.settings.api_timeout_seconds)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return  # the owner is going away; garbage collection is deleting its children
    plan = _planned(ctx, body)
    if plan.problems:
        return
    for manifest in plan.manifests:
        if manifest["kind"] == kind:
            ctx.applier.apply(manifest)
            logger.info("re-created deleted %s %s/%s", kind, namespace, owner)


def _on_child_event(kind: str, kwargs: Mapping[str, Any]) -> None:
    if kwargs["event"].get("type") != "DELETED":
        return
    key = _key(kwargs.get("namespace"), kwargs.get("labels") or {})
    if key is None:
        return
    try:
        repair(kwargs["memo"].ctx, key[0], key[1], kind, kwargs["logger"])
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
