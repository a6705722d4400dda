"""Reconcile: spec → children, written only where they differ. No status here (`status_writer`).

The owners, children and pods are known from Kopf indexes (in-memory, fed by watches), so a
reconcile reads nothing from the API server, and in steady state writes nothing to it either.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kubernetes.client import ApiClient

from ember_operator import render, sizing
from ember_operator.api.models import InferenceDeploymentSpec, ThermalPolicy, parse_spec
from ember_operator.apply import Applier, child_id
from ember_operator.requeue import Requeue
from ember_operator.settings import MANAGED_BY, OperatorSettings
from ember_operator.status_writer import StatusWriter
from ember_operator.thermal.nodes import HotNodes

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}
RENDER_CACHE_SIZE = 4096
INDEX_BY_KIND = {
    "ConfigMap": "configmap_index",
    "Service": "service_index",
    "Deployment": "deployment_index",
    "PodDisruptionBudget": "pdb_index",
}


class Plan(NamedTuple):
    spec: InferenceDeploymentSpec
    sized: sizing.Sizing
    manifests: list[dict[str, Any]]
    problems: list[render.Problem]

    @property
    def adaptive(self) -> bool:
        return self.spec.thermal.policy == ThermalPolicy.ADAPTIVE


@dataclass
class Context:
    api: ApiClient
    applier: Applier
    settings: OperatorSettings
    writer: StatusWriter
    hot: HotNodes
    renders: OrderedDict[tuple[str, int], Plan] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    identities: set[str] = field(default_factory=set)  # namespaces with the runtime's SA
    requeue: Requeue = field(default_factory=Requeue)
    indexes: Mapping[str, Any] = field(default_factory=dict)  # Kopf's, set by the first event
    # Kopf serialises events per object, but an owner's own events and its children's events run
    # in different threads: one lock per owner keeps their reconciles from interleaving.
    owner_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)

    def owner_lock(self, key: tuple[str, str]) -> threading.Lock:
        with self.lock:
            return self.owner_locks.setdefault(key, threading.Lock())

    def forget_owner(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.owner_locks.pop(key, None)
        self.requeue.clear(key)


def key_of(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str] | None:
    owner = labels.get(render.INSTANCE_LABEL)
    return (str(namespace), owner) if owner else None


def first(index: Any, key: tuple[str, str]) -> Mapping[str, Any] | None:
    if index is None or key not in index:
        return None
    return next(iter(index[key]), None)


def planned(ctx: Context, body: Mapping[str, Any]) -> Plan:
    """Everything derived from the spec, cached per (uid, generation): a generation's spec never
    changes, and status refreshes (every pod event) need the plan too."""
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


def ensure_identity(ctx: Context, namespace: str) -> None:
    """The runtime's ServiceAccount and RoleBinding in `namespace`, once per operator process
    (applies are idempotent, so a restart re-applies them once). Not owned by any one
    InferenceDeployment: they serve all of a namespace's replicas and go with the namespace."""
    if namespace in ctx.identities:
        return
    for manifest in render.runtime_identity(namespace, ctx.settings):
        ctx.applier.apply(manifest)
    with ctx.lock:
        ctx.identities.add(namespace)


def apply_children(
    ctx: Context, key: tuple[str, str], manifests: list[dict[str, Any]], indexes: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """Write what differs from the indexed live children; return the Deployment as it is now."""
    ensure_identity(ctx, key[0])
    live = {kind: first(indexes.get(idx), key) for kind, idx in INDEX_BY_KIND.items()}
    written = ctx.applier.ensure(manifests, live)
    wanted = {m["kind"] for m in manifests}
    for kind, obj in live.items():
        if obj is not None and kind not in wanted:  # e.g. the PDB after scaling to one
            ctx.applier.delete(kind, key[0], obj["metadata"]["name"])
    return written.get("Deployment") or live.get("Deployment")


def pods_of(indexes: Mapping[str, Any], key: tuple[str, str]) -> list[Mapping[str, Any]]:
    pod_index = indexes.get("pod_index")
    return list(pod_index[key]) if pod_index is not None and key in pod_index else []


def correct_child(
    ctx: Context,
    key: tuple[str, str],
    kind: str,
    live: Mapping[str, Any] | None,
    indexes: Mapping[str, Any],
) -> str | None:
    """A child's watch event (`live` None: it was deleted): put it back the way the owner's
    current spec wants it. Returns what was done, if anything."""
    owner = first(indexes.get("infd_index"), key)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return None  # the owner is going away; garbage collection deletes its children
    plan = planned(ctx, owner)
    if plan.problems:
        return None  # a running generation is left alone while the spec cannot be served
    manifest = next((m for m in plan.manifests if m["kind"] == kind), None)
    with ctx.owner_lock(key):
        if manifest is None:
            if live is None:
                return None
            ctx.applier.delete(kind, key[0], live["metadata"]["name"])  # e.g. a PDB at 1 replica
            return "deleted"
        if live is None:
            ctx.applier.forget(child_id(manifest))
            ctx.applier.apply(manifest)
            return "re-created"
        return "corrected" if ctx.applier.correct(manifest, live) else None
