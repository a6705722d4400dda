"""The fleet benchmark's arithmetic (bench/operator_bench.py), no cluster; the bench itself
runs in test_operator_bench_cluster.py."""

from __future__ import annotations

from bench import operator_bench


def test_bucket_quantile_reads_only_what_was_observed_between_snapshots() -> None:
    inf = float("inf")
    before = {0.5: 10.0, 1.0: 10.0, 2.0: 10.0, inf: 10.0}
    after = {0.5: 60.0, 1.0: 105.0, 2.0: 109.0, inf: 110.0}  # 50, 45, 4, 1 new
    assert operator_bench.bucket_quantile(before, after, 0.50) == 0.5
    assert operator_bench.bucket_quantile(before, after, 0.90) == 1.0
    assert operator_bench.bucket_quantile(before, after, 0.99) == 2.0
    assert operator_bench.bucket_quantile(before, after, 1.0) is None  # past the last bound
    assert operator_bench.bucket_quantile(after, after, 0.5) is None  # nothing observed
