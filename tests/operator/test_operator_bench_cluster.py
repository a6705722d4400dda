"""The fleet benchmark (bench/operator_bench.py) at a tenth of its size, as a smoke check that it
still runs end to end on the real control plane: its figures are printed, not asserted (speed
and memory goals live in bench/results/, measured on a quiet machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import operator_bench

pytestmark = pytest.mark.cluster


def test_operator_bench_runs_end_to_end(kube: Any, crd: Any, tmp_path: Path) -> None:
    args = ["--objects", "100", "--nodes", "50", "--steady-seconds", "10"]
    args += ["--churn-rate", "20", "--churn-seconds", "10", "--timeout", "600"]
    args += ["--kubeconfig", str(kube.kubeconfig), "--out", str(tmp_path), "--name", "smoke"]
    result = operator_bench.main(args)
    assert result["floor"]["converge_s"] is not None, "plain Deployments never all ready"
    ember = result["ember"]
    assert ember["converge_s"] is not None, "InferenceDeployments never all Ready"
    assert ember["churn_seen"] > 0 and ember["operator_exit_code"] == 0
    assert ember["churn_status_lag_le_s"]["refreshes"] > 0  # the operator's lag histogram
    assert {p.name for p in tmp_path.iterdir()} >= {"smoke.json", "smoke.md", "smoke.png"}
    nodes = kube.kubectl("get", "nodes", "-o", "name")
    assert operator_bench.NODE_PREFIX not in nodes  # the bench cleaned up its fleet
