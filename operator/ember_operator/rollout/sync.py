"""One rollout step for one InferenceDeployment: observe, decide (`progress.advance`), then write
what differs — each site's ConfigMap and Deployment for the revision it runs, the stage requests
on the sites' Nodes, the Events. Runs under the owner's lock, in a reconcile thread."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ember_runtime.contract.rollout import stage_annotation
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import render, sizing
from ember_operator.api import API_VERSION, KIND
from ember_operator.api.models import InferenceDeploymentSpec, RolloutStatus, parse_spec
from ember_operator.apply import digest_of, request, stamp
from ember_operator.context import Context
from ember_operator.events import ObjectRef, record_event
from ember_operator.rollout import observe, progress

log = logging.getLogger(__name__)
REVISION_CACHE_SIZE = 256
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]  # status.rollout as written
    deployment: dict[str, Any]  # the site Deployments' counts, summed (for Ready/Progressing)
    recheck_seconds: float | None


def _old_status(ctx: Context, body: Mapping[str, Any]) -> RolloutStatus | None:
    raw = ctx.writer.last_status(body).get("rollout")
    if not raw:
        return None
    try:
        return RolloutStatus.model_validate(raw)
    except ValidationError:  # written by an older operator, or by hand: start afresh
        log.warning("%s: unreadable status.rollout, starting afresh", body["metadata"]["name"])
        return None


def _spec_of(
    ctx: Context, uid: str, rev: str, spec_body: Mapping[str, Any]
) -> tuple[InferenceDeploymentSpec, Any, sizing.Sizing]:
    """A revision's parsed spec, runtime config and sizing, cached (a revision never changes)."""
    key = (uid, rev)
    with ctx.lock:
        if key in ctx.revisions:
            cached: tuple[InferenceDeploymentSpec, Any, sizing.Sizing] = ctx.revisions[key]
            return cached
    spec = parse_spec(spec_body)
    config = render.runtime_config(spec, ctx.settings)
    sized = sizing.compute(spec, config, ctx.settings, sizing.find_gguf_shape(spec, ctx.settings))
    with ctx.lock:
        ctx.revisions[key] = (spec, config, sized)
        while len(ctx.revisions) > REVISION_CACHE_SIZE:
            ctx.revisions.pop(next(iter(ctx.revisions)))
    return spec, config, sized


def _live(index: Any, key: tuple[str, str]) -> dict[str, Mapping[str, Any]]:
    if index is None or key not in index:
        return {}
    return {str(obj["metadata"]["name"]): obj for obj in index[key]}


def _site_manifests(
    ctx: Context, body: Mapping[str, Any], world: progress.World, decision: progress.Decision
) -> list[dict[str, Any]]:
    meta = body["metadata"]
    owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
    stable_spec = decision.status.stable_spec or world.spec
    out: list[dict[str, Any]] = []
    for site, rev in sorted(decision.revisions.items()):
        source = world.spec if rev == world.update_revision else stable_spec
        spec, config, sized = _spec_of(ctx, meta["uid"], rev, source)
        slice_ = render.SiteSlice(site, world.replicas.get(site, 0), rev)
        for manifest in render.render(owner, spec, config, ctx.settings, sized, slice_=slice_):
            stamp(manifest)
            out.append(manifest)
    return out


def _apply_sites(
    ctx: Context,
    key: tuple[str, str],
    manifests: list[dict[str, Any]],
    indexes: Mapping[str, Any],
) -> dict[str, Any]:
    """Write each site's ConfigMap and Deployment where its digest differs; delete the site
    Deployments and revision ConfigMaps no site runs any more. Returns the Deployments' counts."""
    live = {
        "ConfigMap": _live(indexes.get("configmap_index"), key),
        "Deployment": _live(indexes.get("deployment_index"), key),
    }
    wanted: dict[str, set[str]] = {"ConfigMap": set(), "Deployment": set()}
    current: dict[str, Mapping[str, Any]] = {}
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if name in wanted[kind]:
            continue  # a revision's ConfigMap, shared by its sites
        wanted[kind].add(name)
        ident = (kind, key[0], name)
        have = live[kind].get(name)
        if ctx.applier.in_sync(ident, str(digest_of(manifest)), have):
            current[name] = have or {}
        else:
            current[name] = ctx.applier.apply(manifest)
    for kind, objs in live.items():
        for name in set(objs) - wanted[kind]:
            ctx.applier.delete(kind, key[0], name)
    return _summed([current[n] for n in wanted["Deployment"] if n in current])


def _summed(deployments: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The site Deployments as one, for the Ready and Progressing conditions."""
    fields = ("replicas", "readyReplicas", "updatedReplicas")
    total = {f: 0 for f in fields}
    current = True
    for dep in deployments:
        st = dep.get("status") or {}
        generation = (dep.get("metadata") or {}).get("generation", 0)
        current = current and st.get("observedGeneration", 0) >= generation
        for f in fields:
            total[f] += int(st.get(f, 0) or 0)
    return {
        "metadata": {"generation": 0 if current else 1},
        "status": {**total, "observedGeneration": 0},
    }


def _stage(
    ctx: Context, key: tuple[str, str], sites: Mapping[str, list[Mapping[str, Any]]], want: set[str]
) -> None:
    """The stage request on every Node of the sites in `want`, and on no other Node."""
    ann, value = stage_annotation(*key)
    for site, nodes in sites.items():
        for node in nodes:
            has = ann in (node.get("stage") or [])
            if has == (site in want):
                continue
            patch = {"metadata": {"annotations": {ann: value if site in want else None}}}
            try:
                request(
                    ctx.api,
                    "PATCH",
                    f"/api/v1/nodes/{node['name']}",
                    body=patch,
                    content_type=MERGE_PATCH,
                    timeout=ctx.settings.api_timeout_seconds,
                )
            except ApiException as exc:
                if exc.status != 404:  # a Node gone meanwhile needs no request
                    raise


def unstage(ctx: Context, key: tuple[str, str]) -> None:
    """The object is gone: no Node keeps its stage request."""
    _stage(ctx, key, observe.nodes_by_site(ctx.indexes.get("node_index")), set())


def _announce(ctx: Context, body: Mapping[str, Any], events: list[tuple[str, str, str]]) -> None:
    meta = body["metadata"]
    ref = ObjectRef(API_VERSION, KIND, meta["name"], meta["namespace"], meta["uid"])
    for kind, reason, message in events:
        log.info("%s/%s: %s: %s", meta["namespace"], meta["name"], reason, message)
        try:
            record_event(client.CoreV1Api(ctx.api), ref, reason, message, kind)
        except ApiException as exc:  # status says it too; the Event is the courtesy copy
            log.warning("event %s not posted: %s", reason, exc.reason)


def step(
    ctx: Context, body: Mapping[str, Any], spec: InferenceDeploymentSpec, indexes: Mapping[str, Any]
) -> Outcome:
    meta = body["metadata"]
    key = (str(meta["namespace"]), str(meta["name"]))
    sites = observe.nodes_by_site(indexes.get("node_index"))
    pods = list(indexes["pod_index"][key]) if key in (indexes.get("pod_index") or {}) else []
    now = dt.datetime.now(dt.UTC)
    world = observe.world(spec, body["spec"], sites, pods, now)
    decision = progress.advance(_old_status(ctx, body), world)
    manifests = _site_manifests(ctx, body, world, decision)
    deployment = _apply_sites(ctx, key, manifests, indexes)
    _stage(ctx, key, sites, decision.stage)
    _announce(ctx, body, decision.events)
    status = decision.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return Outcome(status, deployment, decision.recheck_seconds)
