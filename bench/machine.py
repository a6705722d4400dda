"""What the machine itself did to a benchmark: CPU time the hypervisor took away (steal).

These machines are virtual: when the host is busy, a vCPU that wants to run waits, and every
figure of a CPU-bound benchmark moves with it (the same operator bench's floor took 52 s on one
day and 122 s on another). Benchmarks print the steal over their measured spans beside the
load average, so a reader can tell a slow run from a slow machine.
"""

from __future__ import annotations

import os
from pathlib import Path


def steal_seconds() -> float:
    """The machine's steal time since boot (/proc/stat), in CPU seconds; 0 where unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
