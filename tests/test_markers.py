"""Every test's file name, `cluster`/`node` markers and fixtures agree (tests/support/markers.py
says why), checked on what pytest itself collects from the whole suite."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from tests.support.markers import OUT_ENV, Collected, disagreements, load

REPO = Path(__file__).resolve().parents[1]


def collect(out: Path) -> list[Collected]:
    """The whole suite as a child pytest collects it (markers and fixtures resolved)."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    argv += ["-p", "tests.support.markers"]
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, OUT_ENV: str(out)},
        capture_output=True,
        text=True,
        check=False,  # a collection error is the suite's own failure; judge what was collected
    )
    assert out.exists(), f"collection wrote nothing (exit {proc.returncode}):\n{proc.stdout}"
    return load(out)


def test_file_names_markers_and_fixtures_agree(tmp_path: Path) -> None:
    items = collect(tmp_path / "collected.json")
    assert len(items) > 500, f"collected only {len(items)} tests"
    problems = disagreements(items)
    assert not problems, "\n".join(problems)


def _item(nodeid: str, markers: set[str], fixtures: Iterable[str] = ()) -> Collected:
    return Collected(nodeid, frozenset(markers), frozenset(fixtures))


def test_each_disagreement_is_named() -> None:
    bad = [
        _item("tests/a/test_x_node.py::t", {"cluster"}, {"kube"}),
        _item("tests/a/test_x_cluster.py::t", set(), {"kube"}),
        _item("tests/a/test_x_cluster.py::u", {"cluster", "node"}, {"node"}),
        _item("tests/a/test_x.py::t", {"cluster"}, {"kube"}),
        _item("tests/a/test_y.py::t", set(), {"namespace", "kube"}),
        _item("tests/a/test_z_cluster.py::t", {"cluster"}, {"node", "kube"}),
    ]
    assert disagreements(bad) == [
        "tests/a/test_x_node.py::t: in a *_node.py file but marked cluster",
        "tests/a/test_x_cluster.py::t: in a *_cluster.py file but marked no cluster/node marker"
        " (node tests: *_node.py)",
        "tests/a/test_x_cluster.py::t: asks for the cluster (kube) without a cluster/node marker",
        "tests/a/test_x_cluster.py::u: in a *_cluster.py file but marked cluster, node"
        " (node tests: *_node.py)",
        "tests/a/test_x.py::t: marked cluster in a file named neither *_cluster.py nor *_node.py",
        "tests/a/test_y.py::t: asks for the cluster (kube, namespace) without a cluster/node"
        " marker",
        "tests/a/test_z_cluster.py::t: asks for the `node` fixture without the `node` marker",
    ]


def test_one_line_per_file_and_problem() -> None:
    bad = [_item(f"tests/a/test_x.py::t[{i}]", {"cluster"}) for i in range(3)]
    assert disagreements(bad) == [
        "tests/a/test_x.py::t[0]: marked cluster in a file named neither *_cluster.py nor"
        " *_node.py (and 2 more in the file)"
    ]


def test_agreeing_tests_pass() -> None:
    good = [
        _item("tests/a/test_x_node.py::t", {"node"}, {"node", "kube"}),
        _item("tests/a/test_x_node.py::u", {"node", "cluster"}, {"kube"}),
        _item("tests/a/test_x_cluster.py::t", {"cluster"}, {"kube", "fleet"}),
        _item("tests/a/test_x_cluster.py::u", {"cluster"}),  # the cluster by other means
        _item("tests/a/test_x.py::t", set()),
    ]
    assert disagreements(good) == []
