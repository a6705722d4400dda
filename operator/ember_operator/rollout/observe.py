"""What a rollout step sees, read from the operator's indexes (no API call): the sites and their
nodes, each site's pods by revision, whether the new files are on the site."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ember_runtime.contract.cache import CACHE_LABEL_PREFIX, cache_label
from ember_runtime.contract.resource import SITE_LABEL
from ember_runtime.contract.rollout import STAGE_ANNOTATION_PREFIX

from ember_operator.api.models import InferenceDeploymentSpec
from ember_operator.render import site_slug
from ember_operator.rollout import waves
from ember_operator.rollout.progress import PodView, SiteView, World

REVISION_HEX = 10
# Spec fields that do not make a new revision: how many replicas, where (the sites the rollout
# covers), and the rollout's own settings (pausing a rollout must not start another).
UNVERSIONED = ("replicas", "rollout")


def revision_of(spec: Mapping[str, Any]) -> str:
    """The revision of a spec as the API server holds it (defaults filled): a digest of what
    changes the pods."""
    kept = {k: v for k, v in spec.items() if k not in UNVERSIONED}
    placement = {k: v for k, v in (kept.get("placement") or {}).items() if k != "sites"}
    kept["placement"] = placement
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_HEX]


def node_summary(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the node index keeps of a Node with a site: name, labels, Ready, our stage
    requests. A Node without the site label is no site's."""
    meta = body.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    site = labels.get(SITE_LABEL)
    if not site:
        return None
    conditions = (body.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    stage = sorted(
        k for k in (meta.get("annotations") or {}) if k.startswith(STAGE_ANNOTATION_PREFIX)
    )
    return {
        "name": meta.get("name"),
        "site": site,
        "labels": labels,
        "ready": ready,
        "stage": stage,
    }


def nodes_by_site(node_index: Any) -> dict[str, list[Mapping[str, Any]]]:
    if node_index is None:
        return {}
    return {str(site): list(node_index[site]) for site in list(node_index)}


def _staged(spec: InferenceDeploymentSpec, nodes: Iterable[Mapping[str, Any]]) -> bool:
    """The new files are on the site: for an http source, each file's cache label is on some
    node of the site (the node agent sets it for complete, verified files only). Other sources
    need no fetch: they are there, or the pods' own checks say they are not."""
    if spec.model.source.http is None:
        return True
    held: set[str] = set()
    for node in nodes:
        held |= {
            k
            for k, v in (node.get("labels") or {}).items()
            if k.startswith(CACHE_LABEL_PREFIX) and v == "true"
        }
    return all(cache_label(f.sha256) in held for f in spec.model.files)


def _pod_view(pod: Mapping[str, Any]) -> PodView:
    failure = pod.get("failure")
    text = f"{failure['reason']}: {failure['message']}" if failure else None
    return PodView(pod.get("revision"), bool(pod.get("ready")), text, pod.get("health"))


def world(
    spec: InferenceDeploymentSpec,
    spec_body: Mapping[str, Any],
    sites: Mapping[str, list[Mapping[str, Any]]],
    pods: Iterable[Mapping[str, Any]],
    now: dt.datetime,
) -> World:
    """The rollout step's input for one InferenceDeployment."""
    assert spec.rollout is not None
    planned = waves.plan(
        spec.rollout,
        {s: [n["labels"] for n in ns] for s, ns in sites.items()},
        spec.placement.sites,
    )
    covered = [s for w in planned for s in w.sites]
    by_slug: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        if not pod.get("deleting"):
            by_slug.setdefault(str(pod.get("site")), []).append(pod)
    views = {
        site: SiteView(
            reachable=any(n.get("ready") for n in sites.get(site, [])),
            staged=_staged(spec, sites.get(site, [])),
            pods=tuple(_pod_view(p) for p in by_slug.get(site_slug(site), [])),
        )
        for site in covered
    }
    return World(
        update_revision=revision_of(spec_body),
        spec=dict(spec_body),
        rollout=spec.rollout,
        waves=planned,
        sites=views,
        replicas=waves.replicas_per_site(spec.replicas, covered),
        now=now,
    )
