"""Render check results: a table for people, JSON for machines."""

from __future__ import annotations

from typing import Any

from ember_runtime.prewarm.checks import CheckResult, Status

ICONS = {Status.OK: "✅", Status.WARN: "⚠️", Status.FAIL: "❌"}


def summary(results: list[CheckResult]) -> dict[str, int]:
    return {s.value: sum(r.status is s for r in results) for s in Status}


def summary_line(results: list[CheckResult]) -> str:
    counts = summary(results)
    verdict = "FAIL" if counts["fail"] else "OK"
    return f"{verdict}: {counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failed"


def render_table(results: list[CheckResult]) -> str:
    name_w = max([len("check"), *(len(r.name) for r in results)])
    value_w = max([len("value"), *(len(r.value) for r in results)])
    lines = [f"   {'check':<{name_w}}  {'value':<{value_w}}  detail"]
    for r in results:
        # ⚠️ carries a variation selector; pad so the columns still line up in a terminal.
        icon = ICONS[r.status] + (" " if r.status is Status.WARN else "")
        lines.append(f"{icon} {r.name:<{name_w}}  {r.value:<{value_w}}  {r.detail}".rstrip())
    lines.append(summary_line(results))
    return "\n".join(lines)


def to_json(results: list[CheckResult]) -> dict[str, Any]:
    return {
        "ok": not any(r.status is Status.FAIL for r in results),
        "summary": summary(results),
        "checks": [
            {"name": r.name, "status": r.status.value, "value": r.value, "detail": r.detail}
            for r in results
        ],
    }
