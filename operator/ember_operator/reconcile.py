"""Reconcile: spec → children, written only where they differ. No status here (`status_writer`).

The owners, children and pods are known from Kopf indexes (in-memory, fed by watches), so a
reconcile reads nothing from the API server, and in steady state writes nothing to it either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember_runtime.contract.cache import INSTANCE_LABEL
from ember_runtime.contract.config import RuntimeConfig
from pydantic import ValidationError

from ember_operator import render, sizing
from ember_operator.api.models import InferenceDeploymentSpec, parse_spec
from ember_operator.apply import ChildId, digest_of, stamp
from ember_operator.context import Child, Context, Plan
from ember_operator.settings import MANAGED_BY

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}
PLAN_CACHE_SIZE = 4096
# Manifests `planned` just rendered, handed once to the `manifests_of` that follows it in the
# same reconcile (a first reconcile needs both the digests and the manifests: rendering twice
# was a quarter of its CPU). Few: one entry lives from a plan to its apply.
FRESH_CACHE_SIZE = 64
INDEX_BY_KIND = {
    "ConfigMap": "configmap_index",
    "Service": "service_index",
    "Deployment": "deployment_index",
    "PodDisruptionBudget": "pdb_index",
}


ROLLOUT_KINDS = {k: v for k, v in INDEX_BY_KIND.items() if k not in ("ConfigMap", "Deployment")}


def key_of(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str] | None:
    owner = labels.get(INSTANCE_LABEL)
    return (str(namespace), owner) if owner else None


def first(index: Any, key: tuple[str, str]) -> Mapping[str, Any] | None:
    if index is None or key not in index:
        return None
    return next(iter(index[key]), None)


def _render(
    ctx: Context,
    body: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    config: RuntimeConfig,
    sized: sizing.Sizing,
) -> list[dict[str, Any]]:
    meta = body["metadata"]
    owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
    manifests = render.render(owner, spec, config, ctx.settings, sized)
    for manifest in manifests:
        stamp(manifest)
    return manifests


def planned(ctx: Context, body: Mapping[str, Any]) -> Plan:
    """Everything derived from the spec, cached per (uid, generation): a generation's spec never
    changes, and status refreshes (every pod event) need the plan too."""
    key = _plan_key(body)
    with ctx.lock:
        if key in ctx.plans:
            ctx.plans.move_to_end(key)
            return ctx.plans[key]
    spec = parse_spec(body["spec"])
    config = render.runtime_config(spec, ctx.settings)  # the one copy: sized, then rendered
    shape = sizing.find_gguf_shape(spec, ctx.settings)
    draft = spec.engine.draft_model
    drafter = sizing.find_gguf_shape(spec, ctx.settings, draft) if draft else None
    sized = sizing.compute(spec, config, ctx.settings, shape, drafter)
    manifests = _render(ctx, body, spec, config, sized)
    children = {m["kind"]: Child(m["metadata"]["name"], str(digest_of(m))) for m in manifests}
    plan = Plan(spec, config, sized, children, render.problems(spec, sized))
    with ctx.lock:
        ctx.plans[key] = plan
        while len(ctx.plans) > PLAN_CACHE_SIZE:
            ctx.plans.popitem(last=False)
        ctx.fresh[key] = manifests
        while len(ctx.fresh) > FRESH_CACHE_SIZE:
            ctx.fresh.popitem(last=False)
    return plan


def _plan_key(body: Mapping[str, Any]) -> tuple[str, int]:
    meta = body["metadata"]
    return meta["uid"], int(meta.get("generation", 0))


def manifests_of(ctx: Context, body: Mapping[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """The plan's manifests: the ones `planned` just rendered, the first time they are asked
    for, else rendered again (deterministic: the same digests)."""
    with ctx.lock:
        fresh = ctx.fresh.pop(_plan_key(body), None)
    return fresh if fresh is not None else _render(ctx, body, plan.spec, plan.config, plan.sized)


def child_ids(key: tuple[str, str], plan: Plan) -> list[ChildId]:
    return [(kind, key[0], child.name) for kind, child in plan.children.items()]


def ensure_identity(ctx: Context, namespace: str) -> None:
    """The runtime's ServiceAccount and RoleBinding in `namespace`, once per operator process
    (applies are idempotent, so a restart re-applies them once). Not owned by any one
    InferenceDeployment: they serve all of a namespace's replicas and go with the namespace."""
    if namespace in ctx.identities:
        return
    with ctx.owner_lock(("", namespace)):  # one apply per namespace, not one per racing thread
        if namespace in ctx.identities:
            return
        for manifest in render.runtime_identity(namespace, ctx.settings):
            ctx.applier.apply(manifest)
        with ctx.lock:
            ctx.identities.add(namespace)


def _differences(
    ctx: Context, key: tuple[str, str], plan: Plan, indexes: Mapping[str, Any]
) -> tuple[dict[str, Any], set[str], list[tuple[str, str]]]:
    """(live children by kind, kinds to write, (kind, name) to delete — e.g. a PDB after
    scaling to one, or the sites' Deployments after spec.rollout was removed), from the
    indexes and the applier's memory: no API call."""
    # With spec.rollout the ConfigMaps and Deployments are the sites' (`rollout.sync`).
    kinds = ROLLOUT_KINDS if plan.spec.rollout is not None else INDEX_BY_KIND
    live: dict[str, Any] = {}
    unwanted: list[tuple[str, str]] = []
    for kind, idx in kinds.items():
        index = indexes.get(idx)
        objs = list(index[key]) if index is not None and key in index else []
        child = plan.children.get(kind)
        live[kind] = next((o for o in objs if child and _name(o) == child.name), None)
        unwanted += [(kind, _name(o)) for o in objs if child is None or _name(o) != child.name]
    stale = {
        kind
        for kind, child in plan.children.items()
        if not ctx.applier.in_sync((kind, key[0], child.name), child.digest, live.get(kind))
    }
    return live, stale, unwanted


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def apply_children(
    ctx: Context,
    key: tuple[str, str],
    body: Mapping[str, Any],
    plan: Plan,
    indexes: Mapping[str, Any],
) -> Mapping[str, Any] | None:
    """Write the children whose digest differs from the plan's; delete unwanted ones (the PDB
    after scaling to one). Returns the Deployment as it is now (for status)."""
    ensure_identity(ctx, key[0])
    live, stale, unwanted = _differences(ctx, key, plan, indexes)
    written: dict[str, dict[str, Any]] = {}
    if stale:
        for manifest in manifests_of(ctx, body, plan):
            if manifest["kind"] in stale:
                written[manifest["kind"]] = ctx.applier.apply(manifest)
    for kind, name in unwanted:
        ctx.applier.delete(kind, key[0], name)
    return written.get("Deployment") or live.get("Deployment")


def settled(ctx: Context, body: Mapping[str, Any], indexes: Mapping[str, Any]) -> bool:
    """Nothing for a reconcile to write but status: this generation's plan is cached, the
    namespace's runtime identity applied, no retry pending, and every child carries its
    digest (or the spec has a problem, and children are left alone). No render and no API
    call, so the watch handler asks this on the event loop: most events of an object are the
    echoes of its own status writes, and they need a coalesced status refresh, not a thread."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    with ctx.lock:
        plan = ctx.plans.get(_plan_key(body))
        ready = plan is not None and key[0] in ctx.identities
    if plan is None or not ready or key in ctx.requeue:
        return False
    if plan.spec.rollout is not None:
        return False  # each event may move the rollout: `rollout.sync` decides
    if plan.problems:
        return True
    _, stale, unwanted = _differences(ctx, key, plan, indexes)
    return not stale and not unwanted


def pods_of(indexes: Mapping[str, Any], key: tuple[str, str]) -> list[Mapping[str, Any]]:
    pod_index = indexes.get("pod_index")
    return list(pod_index[key]) if pod_index is not None and key in pod_index else []


def _wanted(
    ctx: Context, key: tuple[str, str], kind: str, indexes: Mapping[str, Any]
) -> tuple[Mapping[str, Any], Plan, Child | None] | None:
    """The owner, its plan and the child of `kind` it wants (None: it wants none, e.g. no PDB
    at one replica); None when nothing is to be done — the owner is going away (garbage
    collection deletes its children) or its spec cannot be served (a running generation is
    left alone). Raises ValidationError for a spec the owner's own reconcile reports."""
    owner = first(indexes.get("infd_index"), key)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return None
    plan = planned(ctx, owner)
    if plan.problems or (plan.spec.rollout is not None and kind not in ROLLOUT_KINDS):
        return None  # a site's ConfigMap or Deployment: the owner's rollout step repairs it
    return owner, plan, plan.children.get(kind)


def child_unchanged(
    ctx: Context,
    key: tuple[str, str],
    kind: str,
    live: Mapping[str, Any],
    indexes: Mapping[str, Any],
) -> bool:
    """The child as we wrote or last checked it (or only its status moved): nothing to repair.
    No API call, so the watch handler runs it on the event loop; only the rest takes a thread."""
    try:
        wanted = _wanted(ctx, key, kind, indexes)
    except ValidationError:
        return True
    if wanted is None:
        return True
    child = wanted[2]
    if child is None or _name(live) != child.name:
        return False  # unwanted (e.g. a site's Deployment after spec.rollout went): deleted
    return ctx.applier.verified((kind, key[0], child.name), child.digest, live)


def correct_child(
    ctx: Context,
    key: tuple[str, str],
    kind: str,
    live: Mapping[str, Any] | None,
    indexes: Mapping[str, Any],
) -> str | None:
    """A child's watch event (`live` None: it was deleted): put it back the way the owner's
    current spec wants it. Returns what was done, if anything."""
    wanted = _wanted(ctx, key, kind, indexes)
    if wanted is None:
        return None
    owner, plan, child = wanted
    with ctx.owner_lock(key):
        if child is None or (live is not None and _name(live) != child.name):
            if live is None:
                return None
            ctx.applier.delete(kind, key[0], _name(live))  # e.g. a PDB at 1 replica
            return "deleted"
        return _correct(ctx, (kind, key[0], child.name), live, owner, plan)


def _correct(
    ctx: Context,
    ident: ChildId,
    live: Mapping[str, Any] | None,
    owner: Mapping[str, Any],
    plan: Plan,
) -> str | None:
    digest = plan.children[ident[0]].digest
    if live is not None and ctx.applier.verified(ident, digest, live):
        return None  # the version we wrote or checked, or only its status moved
    (manifest,) = [m for m in manifests_of(ctx, owner, plan) if m["kind"] == ident[0]]
    if live is None:
        ctx.applier.forget(ident)
        ctx.applier.apply(manifest)
        return "re-created"
    return "corrected" if ctx.applier.correct(manifest, live) else None
