"""What the drills share: their size, the operator as a process that can be killed, and the
results file the full versions write (bench/results/drills.{json,md})."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

from bench.operator_bench import ROOT, OperatorProcess

SCALES = ("short", "medium", "full")
RESULTS = ROOT / "bench" / "results"
RECONCILES_RE = re.compile(r"^ember_operator_reconciles_total\{[^}]*\} (\S+)$", re.M)


def scale() -> str:
    """EMBER_DRILL_SCALE: short (the suite's default), medium, or full (`make drills`)."""
    value = os.environ.get("EMBER_DRILL_SCALE", "short")
    if value not in SCALES:
        raise ValueError(f"EMBER_DRILL_SCALE={value!r}: expected one of {SCALES}")
    return value


class Operator:
    """`python -m ember_operator` as its own process (as in the fleet bench), which a drill may
    SIGKILL and start again; each run logs to its own file, so no crash is overwritten."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path) -> None:
        self.kubeconfig, self.namespace, self.log_dir = kubeconfig, namespace, log_dir
        self.runs = 0
        self.proc: OperatorProcess | None = None

    def start(self) -> None:
        self.runs += 1
        log = self.log_dir / f"operator.{self.runs}.log"
        self.proc = OperatorProcess(self.kubeconfig, self.namespace, log)

    def kill(self) -> None:
        """SIGKILL: no cleanup handler runs, nothing is flushed."""
        assert self.proc is not None
        self.proc.proc.kill()
        self.proc.proc.wait(30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def reconciles(self) -> float:
        """The operator's own `ember_operator_reconciles_total`, summed over its labels."""
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.proc.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(float(v) for v in RECONCILES_RE.findall(text))

    def stop(self) -> int:
        assert self.proc is not None
        return self.proc.stop()

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.log_dir.glob("operator.*.log")))

    def tracebacks(self) -> int:
        return self.logs().count("Traceback")


def table(rows: list[tuple[str, Any]]) -> str:
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


# pytest node ID -> the drill it recorded; conftest's report hook adds the verdict.
RECORDED: dict[str, str] = {}


def record(drill: str, result: dict[str, Any], rows: list[tuple[str, Any]]) -> None:
    """Full runs only: merge this drill's result into bench/results/drills.{json,md}. Called
    before the drill's assertions, so a failing run is recorded too; the verdict (`verdict`)
    follows from the test's outcome."""
    results = _load()
    results[drill] = {"result": result, "rows": [[str(n), str(v)] for n, v in rows]}
    _save(results)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if test:
        RECORDED[test] = drill


def verdict(drill: str, passed: bool, detail: str = "") -> None:
    results = _load()
    if drill in results:
        results[drill]["passed"] = passed
        results[drill]["failure"] = "" if passed else detail[:400]
        _save(results)


def _load() -> dict[str, Any]:
    path = RESULTS / "drills.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "drills.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    parts = ["# Fault drills", "", "`make drills` (EMBER_DRILL_SCALE=full). One table a drill.", ""]
    for name, entry in sorted(results.items()):
        outcome = {True: "**passed**", False: "**FAILED**", None: "no verdict"}[entry.get("passed")]
        failure = f": `{entry['failure']}`" if entry.get("failure") else ""
        rows_ = [(n, v) for n, v in entry["rows"]]
        parts += [f"## {name}", "", f"Verdict: {outcome}{failure}", "", table(rows_), ""]
    (RESULTS / "drills.md").write_text("\n".join(parts))
