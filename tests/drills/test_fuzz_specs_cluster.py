"""Drill 2, fuzzed specs (tests/drills/fuzz.py) against the real API server with the operator
running. Reproducible: hypothesis is derandomized (a fixed seed) and keeps no database."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.cache import INSTANCE_LABEL
from hypothesis import HealthCheck, given, settings
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.drills import fuzz
from tests.drills.common import Operator, record, scale, table
from tests.operator import rest
from tests.operator.specs import manifest
from tests.support.waiting import poll

pytestmark = pytest.mark.cluster
EXAMPLES = {"short": 50, "medium": 200, "full": 1000}
SETTLE_SECONDS = 10


def submit(api: ApiClient, ns: str, name: str, case: fuzz.Case) -> ApiException | None:
    """Create it for real, with strict field validation (what `kubectl apply` sends)."""
    body = {**manifest(name), "spec": case.spec}
    try:
        rest.request(
            api, "POST", rest.path("infd", ns), body=body, query=[("fieldValidation", "Strict")]
        )
    except ApiException as exc:
        return exc
    return None


def check_verdict(case: fuzz.Case, refused: ApiException | None) -> None:
    if case.valid:
        assert refused is None, f"valid spec refused: {refused and refused.body}\n{case}"
        return
    assert refused is not None, f"{case.mutation} at {case.path} accepted:\n{case}"
    message = json.loads(refused.body or "{}").get("message", "")
    assert refused.status in (400, 422), (refused.status, message)
    assert case.field in message, f"{case.mutation} at {case.path}: {message!r}"


def served(api: ApiClient, ns: str, name: str) -> str | None:
    """How the operator answered an accepted object: children, or Degraded with a reason."""
    obj = rest.get(api, "infd", ns, name)
    st = (obj or {}).get("status") or {}
    if obj is None or st.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    degraded = [c for c in st.get("conditions") or [] if c["type"] == "Degraded"]
    if degraded and degraded[0]["status"] == "True" and degraded[0].get("reason"):
        return f"Degraded/{degraded[0]['reason']}"
    selector = f"{INSTANCE_LABEL}={name}"
    return "children" if rest.items(api, "deployments", ns, label_selector=selector) else None


def wait_served(api: ApiClient, ns: str, names: list[str], timeout: float) -> dict[str, str | None]:
    """What each object shows once all show something, or what they show at `timeout` (the
    drill reports those that showed nothing)."""
    outcome: dict[str, str | None] = dict.fromkeys(names)

    def all_answered() -> bool:
        for name in [n for n, v in outcome.items() if v is None]:
            outcome[name] = served(api, ns, name)
        return all(outcome.values())

    poll(all_answered, timeout, 1)
    return outcome


def test_fuzzed_specs(crd: Any, namespace: str, tmp_path: Path) -> None:
    api, accepted = crd.api, []
    mutations: dict[str, int] = {}
    operator = Operator(crd.kubeconfig, namespace, tmp_path)
    operator.start()
    try:
        count = iter(range(10**6))

        @settings(
            max_examples=EXAMPLES[scale()],
            derandomize=True,  # a fixed seed: CI sees the same specs every run
            database=None,
            deadline=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.large_base_example,
            ],
        )
        @given(fuzz.cases())
        def one(case: fuzz.Case) -> None:
            name = f"f{next(count)}"
            refused = submit(api, namespace, name, case)
            mutations[case.mutation] = mutations.get(case.mutation, 0) + 1
            check_verdict(case, refused)
            if refused is None:
                accepted.append(name)

        one()
        outcome = wait_served(api, namespace, accepted, timeout=180)
        before = operator.reconciles()
        time.sleep(SETTLE_SECONDS)
        extra = operator.reconciles() - before
        alive = operator.alive()
    finally:
        if operator.alive():
            operator.stop()
    kinds: dict[str, int] = {}
    for how in outcome.values():
        kinds[str(how).split("/")[0]] = kinds.get(str(how).split("/")[0], 0) + 1
    rows: list[tuple[str, Any]] = [
        ("specs (by mutation)", dict(sorted(mutations.items()))),
        ("accepted", len(accepted)),
        ("answered: children / Degraded / nothing", kinds),
        ("Degraded reasons", sorted({v for v in outcome.values() if v and "/" in v})),
        (f"reconciles in {SETTLE_SECONDS} s after (hot loop?)", extra),
        ("operator tracebacks", operator.tracebacks()),
        ("operator alive", alive),
    ]
    print(f"\nfuzzed specs ({scale()})\n{table(rows)}")
    if scale() == "full":
        record("fuzzed specs", {"accepted": len(accepted), "reconciles_after": extra}, rows)
    assert alive, operator.logs()[-4000:]
    assert operator.tracebacks() == 0, operator.logs()[-4000:]
    unanswered = [n for n, v in outcome.items() if v is None]
    assert not unanswered, f"no children and no Degraded: {unanswered}"
    assert extra < max(1, len(accepted)), f"{extra} reconciles in {SETTLE_SECONDS} s: a hot loop"
