"""The one termination-log writer of the node side's containers (prewarm, the runtime server).

The kubelet copies the file into the pod's status, where the operator reads it back
(`reasons.parse_termination_message`) and makes it the `Degraded` reason.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from ember_runtime.contract import reasons


def report(
    path: str | Path, reason: str, detail: str, *, who: str, err: TextIO | None = None
) -> None:
    """One `Reason: detail` line for the pod status; stderr always gets it too, since the file
    may be unwritable (outside Kubernetes there is no termination log)."""
    out = err if err is not None else sys.stderr
    print(f"{who} failed: {reasons.termination_message(reason, detail)}", file=out)
    try:
        reasons.write_termination_message(path, reason, detail)
    except OSError as e:
        print(f"cannot write termination log {path}: {e.strerror}", file=out)
