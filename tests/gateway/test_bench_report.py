"""bench/gateway_bench.py's report (issue 46): every comparison a ratio paired by repeat, every
policy's 429/503s named, each replica's capacity carried. No runtime needed: the report is
derived from a JSON alone (`--replot`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.gateway_bench import POLICIES, derive, render, report


def row(ttft_p99: float, refused: int = 0) -> dict[str, Any]:
    return {
        "requests": 10,
        "completed": 10 - refused,
        "slo_met": 10 - refused,
        "goodput_tok_s": 100.0,
        "throughput_tok_s": 100.0,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": ttft_p99,
        "itl_p99_s": 0.05,
        "errors": {"429": refused} if refused else {},
        "retries": 0.0,
        "gateway_attempts": [1.0, 4.0, 5.0],
    }


def results(per_replica: list[float] | None) -> dict[str, Any]:
    # Repeat 1 ran slow for every policy: a ratio of the medians (4.0 / 2.0 = 2.0) would mix
    # the repeats; paired by repeat the gateway is at half of round robin twice out of three.
    p99 = {"gateway": [1.0, 10.0, 4.0], "round-robin": [2.0, 20.0, 2.0]}
    runs = {
        p: [row(v, refused=3 if p == "kube-proxy" else 0) for v in p99.get(p, [1.0, 1.0, 1.0])]
        for p in POLICIES
    }
    hot = {
        "capacity_req_s": 6.0,
        "offered_req_s": 4.2,
        "batch_limits": [2, 8, 8],
        "runs": runs,
        "date": "2026-12-05T00:00:00Z",
        "loadavg": [0.1, 0.2],
        "steal_seconds": 0.0,
    }
    if per_replica is not None:
        hot["capacity_per_replica_req_s"] = per_replica
    args = {
        "threads": 4, "capacity": 8, "max_queue": 8, "context": 1024, "fraction": 0.7,
        "duration": 25.0, "repeats": 3, "connections": 12, "slo_ttft": 1.0, "slo_tpot": 0.1,
        "workloads": "hot",
    }  # fmt: skip
    return {
        "args": args,
        "where": "a test",
        "date": "2026-12-05T00:00:00Z",
        "cpus": 2,
        "cpu_model": "test",
        "model": "m.gguf",
        "loadavg_before": [0.1],
        "loadavg_after": [0.2],
        "steal_seconds": 0.0,
        "workloads": {"hot": hot},
    }


def test_a_goal_is_the_median_of_the_ratios_paired_by_repeat() -> None:
    out = derive(results([1.0, 2.5, 2.5]))
    goal = out["goals"][0]
    assert goal["ratios"] == [0.5, 0.5, 2.0]
    assert (goal["median"], goal["min"], goal["max"]) == (0.5, 0.5, 2.0)
    assert goal["met"]
    # the comparisons table uses the same pairing, against every baseline
    assert out["comparisons"]["hot"]["round-robin"]["ttft_p99_s"]["ratios"] == [0.5, 0.5, 2.0]
    assert out["comparisons"]["hot"]["kube-proxy"]["ttft_p99_s"]["ratios"] == [1.0, 10.0, 4.0]


def test_every_policys_refusals_and_each_replicas_capacity_are_reported() -> None:
    out = derive(results([1.0, 2.5, 2.5]))
    assert out["refusals"]["hot"] == {
        "kube-proxy": 9,
        "round-robin": 0,
        "least-outstanding": 0,
        "gateway": 0,
    }
    text = render(out)
    assert "kube-proxy 9, round-robin 0, least-outstanding 0, gateway 0" in text
    assert "per replica (replica 0 first): 1.00, 2.50, 2.50 req/s" in text
    assert "per replica: not recorded" in render(derive(results(None)))


def test_replot_rewrites_only_what_is_derived(tmp_path: Path) -> None:
    measured = results([1.0, 2.5, 2.5])
    report(measured, tmp_path, "gateway_bench")
    written = json.loads((tmp_path / "gateway_bench.json").read_text())
    assert {k: written[k] for k in measured} == json.loads(json.dumps(measured))
    assert (tmp_path / "gateway_bench.md").read_text() == render(derive(measured))
    assert (tmp_path / "gateway_bench.png").stat().st_size > 0
