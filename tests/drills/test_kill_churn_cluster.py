"""Drill 1, operator kill -9 during churn (tests/drills/churn.py). The short version runs in the
suite; `make drills` runs the full one (200 objects, 20 kills) and writes bench/results/drills.*."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.drills import churn
from tests.drills.common import Operator, record, scale, table

pytestmark = pytest.mark.cluster
SEED = 15


def test_operator_kill_during_churn(crd: Any, fleet: Any, namespace: str, tmp_path: Path) -> None:
    size = churn.SIZES[scale()]
    nodes = fleet(size.nodes)
    sites = sorted({f"site-{i % 5}" for i in range(len(nodes))})
    rng = random.Random(SEED)
    driver = churn.Driver(crd.api, namespace, sites, rng, [f"c{i}" for i in range(size.objects)])
    operator = Operator(crd.kubeconfig, namespace, tmp_path)
    operator.start()
    try:
        for name in driver.names:
            driver.create(name)
        last_start = churn.churn(driver, operator, size)
        ops_done = time.monotonic()
        took, found = churn.converge(crd.api, namespace, driver.replicas, size.converge_timeout)
        assert operator.alive(), operator.logs()[-4000:]
    finally:
        if operator.alive():
            operator.stop()
    since_kill = None if took is None else round(ops_done + took - last_start, 1)
    rows: list[tuple[str, Any]] = [
        ("objects at start / at end", f"{size.objects} / {len(driver.replicas)}"),
        ("kills (SIGKILL + restart)", operator.runs - 1),
        ("operations", dict(driver.done)),
        ("convergence after the last restart (s)", since_kill if took is not None else "never"),
        ("… after the last operation (s)", "never" if took is None else round(took, 1)),
        *((kind, count) for kind, count in found.counts().items()),
        ("operator tracebacks", operator.tracebacks()),
    ]
    print(f"\noperator kill -9 during churn ({scale()}, seed {SEED})\n{table(rows)}")
    if scale() == "full":
        record("operator kill -9 during churn", {"took_s": since_kill, **found.counts()}, rows)
    assert found.clean(), vars(found)
    assert operator.tracebacks() == 0, operator.logs()[-4000:]
