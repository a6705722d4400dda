"""The e2e flow's own logic that needs no cluster: when a wait gives up on a Degraded object."""

from __future__ import annotations

import datetime as dt
from typing import Any

from tests.e2e.flow import OUTAGE_GRACE_SECONDS, REFUSED, DegradedClock, refusals


def _obj(reason: str | None, message: str = "") -> dict[str, Any]:
    status = "True" if reason else "False"
    cond = {"type": "Degraded", "status": status, "reason": reason or "AsExpected"}
    return {"status": {"conditions": [{**cond, "message": message}]}}


def test_a_reason_that_stands_fails_with_its_message() -> None:
    now = [100.0]
    clock = DegradedClock(grace=90, clock=lambda: now[0])
    stuck = _obj("Unschedulable", "0/1 nodes are available: 1 Insufficient cpu.")
    assert clock.update(stuck) is None
    now[0] += 89
    assert clock.update(stuck) is None
    now[0] += 2
    assert clock.update(stuck) == (
        "Degraded Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
    )


def test_a_reason_that_clears_or_changes_restarts_the_clock() -> None:
    now = [0.0]
    clock = DegradedClock(grace=90, clock=lambda: now[0])
    for step in (_obj("Unschedulable"), _obj(None), _obj("Unschedulable"), _obj("Pulling")):
        assert clock.update(step) is None  # a rollout freeing room: never a failure
        now[0] += 60
    assert clock.update(_obj("Pulling")) is None  # 60 s of this reason so far
    assert clock.update({"status": {}}) is None  # no conditions yet


def test_refused_matches_a_403_but_not_a_timestamp() -> None:
    clean = "[2026-11-30 18:36:53,403] ember_operator.apply [INFO    ] applied Deployment t/rbac"
    assert not REFUSED.search(clean)
    assert REFUSED.search("kubernetes.client.exceptions.ApiException: (403)")
    assert REFUSED.search('events "x" is forbidden: User cannot create')
    assert REFUSED.search("HTTP 403 on PATCH")


def test_refusals_right_after_an_api_server_outage_are_not_rbac() -> None:
    line = "[2026-11-30 21:25:41,080] kopf._cogs.clients.w [ERROR   ] attempt #2/9 failed: (403)"
    at = dt.datetime(2026, 11, 30, 21, 25, 41, 80_000, tzinfo=dt.UTC).timestamp()
    assert refusals(line, []) == [line]
    assert refusals(line, [(at - 20, at - 1)]) == []  # within the grace after the restart
    assert refusals(line, [(at - 100, at - OUTAGE_GRACE_SECONDS - 1)]) == [line]  # long after
    assert refusals(line, [(at + 1, at + 5)]) == [line]  # before the outage
    untimed = "Forbidden: something without a timestamp"
    assert refusals(untimed, [(0, 2e9)]) == [untimed]
