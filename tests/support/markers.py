"""What a test needs, said three ways that must agree: its file's name, its markers, and the
fixtures it asks for.

`make test-unit` selects by marker alone (`-m "not cluster and not node"`), and a reader finds
what a test needs from its file's name: `*_cluster.py` needs the local control plane (marker
`cluster`), `*_node.py` the real kubelet node too (marker `node`); a file named neither needs
neither. The session fixtures of `tests/conftest.py` start that cluster: a test that asks for one
(even through another fixture) without the marker would start a cluster in the unit run.

Also a pytest plugin: `-p tests.support.markers` with `EMBER_MARKERS_OUT=<file>` writes what
collection found as JSON (`tests/test_markers.py` runs it in a child pytest).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

MARKERS = ("cluster", "node")
# The module whose fixtures are the cluster (kube, node, fleet, namespace, cluster itself).
CLUSTER_FIXTURES_MODULE = "tests.conftest"
NODE_FIXTURE = "node"
OUT_ENV = "EMBER_MARKERS_OUT"


@dataclass(frozen=True)
class Collected:
    """One collected test: its id, its cluster/node markers, and the fixtures of its closure
    that `tests/conftest.py` defines."""

    nodeid: str
    markers: frozenset[str]
    cluster_fixtures: frozenset[str]

    @property
    def suffix(self) -> str | None:
        """What the file's name says it needs: "node", "cluster" or None."""
        name = self.nodeid.split("::", 1)[0]
        return next((m for m in MARKERS if name.endswith(f"_{m}.py")), None)


def disagreements(items: Iterable[Collected]) -> list[str]:
    """One line for each way a file's tests disagree with its name or their fixtures, naming
    the first such test and how many more there are."""
    found: dict[tuple[str, str], list[str]] = {}
    for item in items:
        for why in _problems(item):
            found.setdefault((item.nodeid.split("::", 1)[0], why), []).append(item.nodeid)
    return [
        f"{ids[0]}: {why}" + (f" (and {len(ids) - 1} more in the file)" if len(ids) > 1 else "")
        for (_, why), ids in found.items()
    ]


def _problems(item: Collected) -> list[str]:
    marks, suffix = item.markers, item.suffix
    shown = ", ".join(sorted(marks)) or "no cluster/node marker"
    problems = []
    if suffix == "node" and "node" not in marks:
        problems.append(f"in a *_node.py file but marked {shown}")
    elif suffix == "cluster" and marks != {"cluster"}:
        problems.append(f"in a *_cluster.py file but marked {shown} (node tests: *_node.py)")
    elif suffix is None and marks:
        problems.append(f"marked {shown} in a file named neither *_cluster.py nor *_node.py")
    if NODE_FIXTURE in item.cluster_fixtures and "node" not in marks:
        problems.append("asks for the `node` fixture without the `node` marker")
    elif item.cluster_fixtures and not marks:
        fixtures = ", ".join(sorted(item.cluster_fixtures))
        problems.append(f"asks for the cluster ({fixtures}) without a cluster/node marker")
    return problems


def load(path: Path) -> list[Collected]:
    rows = json.loads(path.read_text())
    return [
        Collected(r["nodeid"], frozenset(r["markers"]), frozenset(r["cluster_fixtures"]))
        for r in rows
    ]


def _collected(item: pytest.Item) -> dict[str, object]:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    cluster = [
        name
        for name, chain in defs.items()
        if chain and chain[-1].func.__module__ == CLUSTER_FIXTURES_MODULE
    ]
    marks = {m.name for m in item.iter_markers()} & set(MARKERS)
    return {"nodeid": item.nodeid, "markers": sorted(marks), "cluster_fixtures": sorted(cluster)}


def pytest_collection_finish(session: pytest.Session) -> None:
    out = os.environ.get(OUT_ENV)
    if out:
        Path(out).write_text(json.dumps([_collected(item) for item in session.items]))
