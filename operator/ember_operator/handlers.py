"""Kopf wiring only: which events call what, each handler a few lines. What the events do is in
`controller`; the clients, caches and indexes they share in `context`; Kopf's own plumbing
(login, diff base, log filter, settings, background tasks) in `kopf_setup`.

Indexes are Kopf's (in-memory, fed by watches) and reach the start-up handler as typed
arguments; the context keeps them, since delayed work (retries, coalesced refreshes) reads
them outside any handler. No timers, no finalizers, no change-detecting handlers: nothing of
Kopf's state is written on the objects (`kopf_setup.NoDiffBase` relies on that).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from ember_runtime.contract.resource import SITE_LABEL

from ember_operator import context, controller, kopf_setup, kubelet_events, metrics
from ember_operator.api import GROUP, PLURAL, VERSION
from ember_operator.reconcile import CHILD_LABELS, key_of
from ember_operator.rollout.observe import node_summary
from ember_operator.settings import load_settings

RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf_setup.login(**kwargs)


@kopf.on.startup()  # type: ignore[arg-type]  # Kopf passes indexes by name; its protocol omits them
def configure(
    *,
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    infd_index: kopf.Index[Any, Any],
    configmap_index: kopf.Index[Any, Any],
    service_index: kopf.Index[Any, Any],
    deployment_index: kopf.Index[Any, Any],
    pdb_index: kopf.Index[Any, Any],
    pod_index: kopf.Index[Any, Any],
    node_index: kopf.Index[Any, Any],
    **_: Any,
) -> None:
    kopf_setup.configure(settings, {kubelet_events.EVENTS: kubelet_events.FIELD_SELECTOR})
    indexes = dict(
        zip(
            context.INDEXES,
            (
                infd_index,
                configmap_index,
                service_index,
                deployment_index,
                pdb_index,
                pod_index,
                node_index,
            ),
            strict=True,
        )
    )
    # Read at start-up, not at import: a process that imported this module earlier (a test
    # harness running several operators in turn) still gets the environment of this start.
    memo.ctx = context.build(load_settings(), indexes)


@kopf.on.startup()
async def start(memo: kopf.Memo, **_: Any) -> None:
    """After `configure` (Kopf keeps declaration order): adopt nodes already tainted hot, then
    serve the queues of delayed work: the hot nodes, retries, coalesced status refreshes."""
    ctx: context.Context = memo.ctx
    await asyncio.to_thread(ctx.hot.adopt_tainted)
    kopf_setup.start(memo, "ember-hot-nodes", ctx.hot.run())
    retry = ctx.requeue.run(lambda key, attempt: controller.retry(ctx, key, attempt))
    kopf_setup.start(memo, "ember-retries", retry)
    due = ctx.refreshes.run(lambda key, first: controller.refresh_due(ctx, key, first))
    kopf_setup.start(memo, "ember-status-refresh", due)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await kopf_setup.stop(memo)
    if memo.get("ctx") is not None:
        context.close(memo.ctx)


@kopf.on.probe(id="reconciles")
def probe_reconciles(**_: Any) -> float:
    return metrics.reconciles_total()


# Indexes: async, though they never await: Kopf runs a sync handler in its thread pool (a
# submit, a shielded future, a context copy), and every watch event of every child and pod
# passes through an index; these are a few dict lookups, cheaper than the hop.


@kopf.index(*RESOURCE)
async def infd_index(*, body: kopf.Body, namespace: str | None, name: str | None, **_: Any) -> Any:
    return controller.owner_summary(body, namespace, name)


@kopf.index("v1", "configmaps", labels=CHILD_LABELS)
async def configmap_index(
    *, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> Any:
    return controller.child_summary(body, namespace, labels)


@kopf.index("v1", "services", labels=CHILD_LABELS)
async def service_index(
    *, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> Any:
    return controller.child_summary(body, namespace, labels)


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_index(
    *, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> Any:
    return controller.child_summary(body, namespace, labels)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def pdb_index(
    *, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> Any:
    return controller.child_summary(body, namespace, labels)


@kopf.index("v1", "pods", labels=CHILD_LABELS)
async def pod_index(
    *, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> Any:
    return controller.pod_summary(body, namespace, labels)


# Nodes with a site (rollouts read their Ready, labels and stage requests): few fields kept.
@kopf.index("v1", "nodes", labels={SITE_LABEL: kopf.PRESENT})
async def node_index(*, body: kopf.Body, **_: Any) -> Any:
    summary = node_summary(body)
    return {summary["site"]: summary} if summary else {}


@kopf.on.event("v1", "nodes", labels={SITE_LABEL: kopf.PRESENT})
async def node_event(*, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    controller.node_changed(memo.ctx, body, event.get("type") == "DELETED")


# Events. Async: most need no thread (`controller` takes one only for real work).


@kopf.on.event(*RESOURCE)
async def infd_event(*, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await controller.owner_changed(memo.ctx, event, body)


@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def pod_event(
    *,
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    key = key_of(namespace, labels or {})
    if key is not None:
        controller.pod_changed(memo.ctx, key, event, body)


async def _child_event(kind: str, **kwargs: Any) -> None:
    key = key_of(kwargs["namespace"], kwargs["labels"] or {})
    if key is not None:
        await controller.child_changed(
            kwargs["memo"].ctx, kind, key, kwargs["event"], kwargs["body"]
        )


@kopf.on.event("v1", "configmaps", labels=CHILD_LABELS)
async def configmap_event(**kwargs: Any) -> None:
    await _child_event("ConfigMap", **kwargs)


@kopf.on.event("v1", "services", labels=CHILD_LABELS)
async def service_event(**kwargs: Any) -> None:
    await _child_event("Service", **kwargs)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_event(**kwargs: Any) -> None:
    await _child_event("Deployment", **kwargs)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def pdb_event(**kwargs: Any) -> None:
    await _child_event("PodDisruptionBudget", **kwargs)


@kopf.on.event(*kubelet_events.EVENTS)
def kubelet_event(*, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Sync: Kopf runs it in its thread pool (a status write may follow)."""
    controller.kubelet_warned(memo.ctx, event, body)
