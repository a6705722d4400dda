"""Prometheus metrics of the operator (served by `python -m ember_operator --metrics-port`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "ember_operator_reconciles_total",
    "Reconciles of InferenceDeployments by trigger and result.",
    ["trigger", "result"],
)
RECONCILE_SECONDS = Histogram(
    "ember_operator_reconcile_duration_seconds",
    "Time spent in one reconcile.",
    ["trigger"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
API_WRITES = Counter(
    "ember_operator_api_writes_total",
    "Writes this operator sent to the API server.",
    ["kind", "verb"],
)
STATUS_LAG = Histogram(
    "ember_operator_status_lag_seconds",
    "From the first event that changed what an object's status shows (a pod's readiness or "
    "thermal report, a rollout) to that status refresh having been written: the coalescing "
    "window plus any queue behind it. It grows when the operator or the API server falls "
    "behind the fleet's changes.",
    buckets=(0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 30, 60),
)
OBJECTS = Gauge(
    "ember_operator_objects",
    "InferenceDeployments by condition type and status.",
    ["condition", "status"],
)

_lock = threading.Lock()
_by_object: dict[tuple[str, str], dict[str, str]] = {}


def record_conditions(key: tuple[str, str], conditions: Mapping[str, str] | None) -> None:
    """Remember one object's condition statuses (None: forget it); O(1) gauge update."""
    with _lock:
        old = _by_object.pop(key, {})
        for ctype, status in old.items():
            OBJECTS.labels(condition=ctype, status=status).dec()
        if conditions is not None:
            _by_object[key] = dict(conditions)
            for ctype, status in conditions.items():
                OBJECTS.labels(condition=ctype, status=status).inc()


def reconciles_total() -> float:
    """All reconciles so far, whatever their trigger and result: the liveness probe's figure."""
    return sum(
        s.value for m in RECONCILES.collect() for s in m.samples if s.name.endswith("_total")
    )
