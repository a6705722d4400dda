"""How long the README's commands take on this machine, recorded rather than guessed.

    .venv/bin/python bench/ci_time.py NAME -- COMMAND...    # run COMMAND, record its wall time
    .venv/bin/python bench/ci_time.py --report              # rewrite the md from the JSON

Each entry (NAME, the command, its wall seconds, its exit status, when, the machine's cores and
memory, the load average before and after, the CPU time the hypervisor stole) is added to
`bench/results/ci_time.json`, and `ci_time.md` is rewritten from it. A cold run is one on a
machine whose `~/.cache/ember` was empty when it began; the entry's name says which it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import steal_seconds

RESULTS = Path(__file__).resolve().parent / "results"


def _machine() -> dict[str, Any]:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpus": os.cpu_count(), "memory_gib": round(pages / 2**30, 1)}


def timed(name: str, command: list[str]) -> dict[str, Any]:
    """Run `command` (its output passes through) and describe the run."""
    load, steal = os.getloadavg(), steal_seconds()
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.monotonic()
    rc = subprocess.run(command, check=False).returncode
    return {
        "name": name,
        "command": command,
        "seconds": round(time.monotonic() - t0, 1),
        "exit_status": rc,
        "started": started,
        **_machine(),
        "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "stolen_cpu_s": round(steal_seconds() - steal, 1),
    }


def markdown(entries: list[dict[str, Any]]) -> str:
    rows = [
        "# Wall time of the README's commands on this project's machine",
        "",
        "`python bench/ci_time.py NAME -- COMMAND` ran each; cold: `~/.cache/ember` empty at "
        "its start.",
        "",
        "| name | command | min | s | exit | started | CPUs | GiB | load before | stolen CPU s |",
        "|---|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for e in entries:
        # The first entry was timed before this script: no load or steal recorded for it.
        load = "/".join(f"{x:.2f}" for x in e["load_before"]) if e["load_before"] else "-"
        stolen = "-" if e["stolen_cpu_s"] is None else e["stolen_cpu_s"]
        rows.append(
            f"| {e['name']} | `{' '.join(e['command'])}` | {e['seconds'] / 60:.1f} | "
            f"{e['seconds']:.0f} | {e['exit_status']} | {e['started']} | {e['cpus']} | "
            f"{e['memory_gib']} | {load} | {stolen} |"
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--report", action="store_true", help="rewrite the md only")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    path = RESULTS / "ci_time.json"
    entries: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    if not args.report:
        if not args.name or not command:
            ap.error("NAME -- COMMAND... (or --report)")
        entry = timed(args.name, command)
        entries.append(entry)
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(entries, indent=2) + "\n")
    (RESULTS / "ci_time.md").write_text(markdown(entries))
    if not args.report and entries[-1]["exit_status"]:
        sys.exit(entries[-1]["exit_status"])


if __name__ == "__main__":
    main()
