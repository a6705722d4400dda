"""The Kopf wiring's assumptions, and the plan caches, checked without a cluster."""

from __future__ import annotations

from typing import Any

import ember_operator.handlers  # noqa: F401  (importing registers Ember's handlers)
import kopf
from ember_operator import apply, context, controller, kopf_setup, metrics, reconcile, requeue
from ember_operator.settings import OperatorSettings
from kopf._cogs.structs import diffs

from tests.operator.specs import manifest


def test_no_change_detecting_handlers_so_the_empty_diff_base_is_safe() -> None:
    """`NoDiffBase` gives Kopf an empty essence for every body: right only while no handler
    needs Kopf's diffs. An on.create/update/resume/field handler, a timer or a daemon added
    to Ember later must come with Kopf's own storage back (`kopf_setup.configure`)."""
    registry = kopf.get_default_registry()

    def ours(found: Any) -> list[Any]:  # the suite also loads a toy operator into it
        return [h for h in found if h.fn.__module__.startswith("ember_operator")]

    # Kopf has no public accessor; these are the registries `_detect_causes` consults.
    assert ours(registry._changing.get_all_handlers()) == []
    assert ours(registry._spawning.get_all_handlers()) == []
    assert ours(registry._watching.get_all_handlers())  # the on.event handlers are there


def test_a_process_with_change_handlers_keeps_kopfs_diff_base() -> None:
    registry = kopf.OperatorRegistry()
    assert not kopf_setup.has_change_handlers(registry)

    @kopf.on.create("example.dev", "v1", "things", registry=registry)
    def created(**_: Any) -> None: ...

    assert kopf_setup.has_change_handlers(registry)


def test_empty_diff_base_copies_nothing_and_diffs_empty() -> None:
    storage = kopf_setup.NoDiffBase()
    raw: kopf.RawBody = {
        "metadata": {"name": "a", "labels": {"app": "x"}},
        "spec": {"replicas": 2},
        "status": {"phase": "Ready"},
    }
    body = kopf.Body(raw)
    old, new = storage.fetch(body=body), storage.build(body=body)
    assert old == new == {}
    assert diffs.diff(old, new) == ()


def _context() -> context.Context:
    # Only the plan caches and settings are used here; no API client is needed.
    unused: Any = None
    settings = OperatorSettings(runtime_image="example/runtime:1")
    return context.Context(
        api=unused, applier=unused, settings=settings, writer=unused, hot=unused, steps=unused
    )


def test_a_fresh_plan_hands_its_manifests_to_the_apply_once() -> None:
    ctx = _context()
    body = {**manifest("demo"), "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1"}}
    body["metadata"]["generation"] = 1
    plan = reconcile.planned(ctx, body)
    first = reconcile.manifests_of(ctx, body, plan)  # the ones `planned` rendered
    again = reconcile.manifests_of(ctx, body, plan)  # rendered anew: equal, not the same
    assert first == again and first is not again
    assert {m["kind"]: apply.digest_of(m) for m in first} == {
        kind: child.digest for kind, child in plan.children.items()
    }
    assert not ctx.fresh  # handed out once, not kept per object


def test_fresh_manifests_are_bounded() -> None:
    ctx = _context()
    for i in range(reconcile.FRESH_CACHE_SIZE + 10):
        meta = {"name": f"o{i}", "namespace": "ns", "uid": f"u-{i}", "generation": 1}
        reconcile.planned(ctx, {**manifest(f"o{i}"), "metadata": meta})
    assert len(ctx.fresh) == reconcile.FRESH_CACHE_SIZE


def _lag_samples() -> tuple[float, float]:
    """(count, sum) of the status lag histogram so far."""
    samples = {s.name: s.value for m in metrics.STATUS_LAG.collect() for s in m.samples}
    return samples["ember_operator_status_lag_seconds_count"], samples[
        "ember_operator_status_lag_seconds_sum"
    ]


def test_a_due_refresh_records_its_lag_from_the_first_mark() -> None:
    """The lag metric is what tells a fleet's SRE how far status trails the pods: it runs
    from the first mark of a coalesced burst (the Coalescer's own clock) to the refresh."""
    ctx = _context()
    now = [50.0]
    ctx.refreshes = requeue.Coalescer(window=0.5, clock=lambda: now[0])
    ctx.refreshes.mark(("ns", "gone"))  # not in any index: the refresh itself is a no-op
    now[0] = 53.25
    due = ctx.refreshes.take_due()
    assert due == [(("ns", "gone"), 50.0)]
    count, total = _lag_samples()
    controller.refresh_due(ctx, *due[0])
    assert _lag_samples() == (count + 1, total + 3.25)
