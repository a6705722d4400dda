"""`make bench`: every benchmark in turn, each printing its own table (results in bench/results/).

    python bench/run_all.py [NAME ...]  # deviceplugin prewarm runtime operator thermal clients

Benchmarks are not tests: they print figures side by side with their peer; nothing here asserts
a speed. Several need root (page-cache drops, loop devices, cgroups) and the local cluster.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ORDER = ("deviceplugin", "prewarm", "runtime", "operator", "thermal", "clients")
SCRIPTS = {"clients": "clients_matrix.py"}  # the others are <name>_bench.py


def main(argv: list[str]) -> int:
    names = argv or list(ORDER)
    unknown = sorted(set(names) - set(ORDER))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(ORDER)}")
        return 2
    failed = []
    for name in names:
        script = SCRIPTS.get(name, f"{name}_bench.py")
        print(f"\n=== bench/{script} ===", flush=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(BENCH / script)], check=False)
        print(f"=== {name}: exit {proc.returncode} in {time.monotonic() - start:.0f}s", flush=True)
        if proc.returncode:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
