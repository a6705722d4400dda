"""The wave planner: which sites go in which wave, from spec.rollout and the sites that exist.

A site is the value of the node label `ember.dev/site`. The sites a rollout covers are the
spec's `placement.sites`, or, without them, every site some node carries. Each wave takes sites
no earlier wave took: explicit names (those that exist), the sites of the nodes a selector
matches, or the next `count` / `percent` of them in name order. Sites no wave took form a last
wave, `rest`, with the last wave's bake time. A wave left empty (its sites are all taken, or do
not exist) is kept, empty, so status shows the spec's waves as written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ember_operator.api.models import LabelSelectorRequirement, NodeLabelSelector, RolloutSpec

REST = "rest"
Labels = Mapping[str, str]


@dataclass(frozen=True)
class Wave:
    name: str
    sites: tuple[str, ...]
    bake_seconds: int


def _requirement(req: LabelSelectorRequirement, labels: Labels) -> bool:
    if req.operator == "Exists":
        return req.key in labels
    if req.operator == "DoesNotExist":
        return req.key not in labels
    inside = labels.get(req.key) in req.values
    return inside if req.operator == "In" else req.key not in labels or not inside


def selects(selector: NodeLabelSelector, labels: Labels) -> bool:
    """A Kubernetes label selector's meaning (matchLabels AND every expression)."""
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    return all(_requirement(r, labels) for r in selector.match_expressions)


def plan(
    rollout: RolloutSpec, nodes_by_site: Mapping[str, Iterable[Labels]], wanted: Iterable[str] = ()
) -> list[Wave]:
    """The waves, in order, over `wanted` sites (all of `nodes_by_site` when empty)."""
    sites = sorted(set(wanted) or set(nodes_by_site))
    left = list(sites)
    waves: list[Wave] = []
    for spec in rollout.waves:
        if spec.sites is not None:
            taken = [s for s in left if s in set(spec.sites)]
        elif spec.selector is not None:
            selector = spec.selector
            taken = [s for s in left if any(selects(selector, n) for n in nodes_by_site.get(s, ()))]
        elif spec.count is not None:
            taken = left[: spec.count]
        else:
            share = math.ceil(len(sites) * (spec.percent or 0) / 100)
            taken = left[: max(1, share)]
        left = [s for s in left if s not in set(taken)]
        waves.append(Wave(spec.name, tuple(taken), spec.bake_seconds))
    if left:
        waves.append(Wave(REST, tuple(left), rollout.waves[-1].bake_seconds))
    return waves


def replicas_per_site(total: int, sites: Iterable[str]) -> dict[str, int]:
    """`spec.replicas` split evenly over the sites, the remainder to the first in name order."""
    ordered = sorted(sites)
    if not ordered:
        return {}
    base, extra = divmod(total, len(ordered))
    return {site: base + (1 if i < extra else 0) for i, site in enumerate(ordered)}
