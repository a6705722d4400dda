"""The one reason vocabulary (ember_runtime.contract.reasons) against what uses it: the
operator's code and the README's troubleshooting table."""

from __future__ import annotations

import ast
from pathlib import Path

from ember_runtime.contract import reasons

REPO = Path(__file__).resolve().parents[2]
# Calls whose argument at this position is a reason the user sees.
REASON_ARGS = {"Problem": 0, "PodFailure": 0, "_condition": 2}


def _literal_reasons(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        pos = REASON_ARGS.get(name)
        if pos is None or len(node.args) <= pos:
            continue
        arg = node.args[pos]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((node.lineno, arg.value))
    return found


def test_every_reason_the_operator_writes_is_in_the_vocabulary() -> None:
    unknown = [
        f"{path.relative_to(REPO)}:{line}: {value}"
        for path in sorted((REPO / "operator" / "ember_operator").rglob("*.py"))
        for line, value in _literal_reasons(path)
        if value not in reasons.REASONS
    ]
    assert unknown == [], (
        "add these to ember_runtime/contract/reasons.py (and regenerate the README)"
    )


def test_readme_lists_every_reason_with_what_to_do() -> None:
    readme = (REPO / "README.md").read_text()
    assert reasons.with_table(readme) == readme, (
        "README's reason table is stale: run `python -m ember_runtime.contract.reasons README.md`"
    )
    for reason in reasons.REASONS.values():
        assert f"| `{reason.name}` |" in readme
        assert reason.action.strip()


def test_pod_event_reasons_are_kubelet_reasons() -> None:
    assert all(reasons.REASONS[r].source == reasons.KUBELET for r in reasons.POD_EVENT_REASONS)
