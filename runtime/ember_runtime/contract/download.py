"""A waiting replica's download progress, in one sentence that two processes write.

The node agent, which does the download, puts it in the pod's `ember.dev/ModelDownload`
condition while prewarm waits (nodeagent/podprogress.py); prewarm, which has no API access,
exits with it as its `ModelDownloading` termination message after its wait (prewarm/cachewait.py).
The operator shows either one to the user, so both say it the same way:

    node-a: 1.2 of 3.4 GB in the node cache, ETA 3m03s (12.0 MB/s over 1m40s)
"""

from __future__ import annotations

from dataclasses import dataclass


def human_bytes(done: int, total: int) -> str:
    """`1.2 of 3.4 GB`: both in the total's unit (decimal, as disks and links are sold)."""
    unit, scale = "B", 1
    for name, size in (("kB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12)):
        if total >= size:
            unit, scale = name, size
    if scale == 1:
        return f"{done} of {total} B"
    return f"{done / scale:.1f} of {total / scale:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """`45s`, `2m10s`, `3h05m`: an ETA needs two figures at most."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def human_rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e6:
        return f"{bytes_per_second / 1e6:.1f} MB/s"
    return f"{bytes_per_second / 1e3:.1f} kB/s"


@dataclass(frozen=True)
class Observation:
    """The cache's bytes for this pod's files at one moment (monotonic seconds)."""

    at: float
    done: int


def progress_message(
    node: str, first: Observation, last: Observation, total: int, note: str = ""
) -> str:
    """The ModelDownloading detail: node, bytes, ETA from the growth between two looks."""
    waited = last.at - first.at
    rate = (last.done - first.done) / waited if waited > 0 else 0.0
    if rate > 0:
        eta = f"ETA {human_duration((total - last.done) / rate)}"
        speed = f" ({human_rate(rate)} over {human_duration(waited)})"
    else:
        eta, speed = "ETA unknown", f" (no progress in {human_duration(waited)})"
    return f"{node}: {human_bytes(last.done, total)} in the node cache, {eta}{speed}{note}"
