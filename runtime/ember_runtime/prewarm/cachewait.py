"""Wait for the node agent to put an http source's files into the node cache.

Prewarm mounts the cache read-only and never fetches: the agent on the node does, once for all
pods there. A final name under `sha256/` holds only verified bytes, so its presence is enough;
prewarm still hashes it again while copying. A download that failed for good is recorded by the
agent as a termination line under `failed/<digest>`, which prewarm reports as its own (so a wrong
sha256 shows as `ChecksumMismatch` on the InferenceDeployment). After `model_wait_seconds`
prewarm exits with `ModelDownloading`, so a slow download is visible in the object's status;
the kubelet restarts it and it waits again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TextIO

from ember_runtime import reasons
from ember_runtime.config import ModelFile, RuntimeConfig
from ember_runtime.prewarm.errors import Interrupted, PrewarmError


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _held(config: RuntimeConfig, f: ModelFile) -> bool:
    return _size(config.source_file(f)) == f.size_bytes


def _done_bytes(config: RuntimeConfig) -> int:
    """Bytes on the node so far: whole files plus the agent's partials (stat needs no read)."""
    total = 0
    for f in config.files:
        final = config.source_file(f)
        partial = final.with_name(f"{final.name}.partial")
        total += f.size_bytes if _held(config, f) else min(_size(partial), f.size_bytes)
    return total


def _waiting_note(config: RuntimeConfig) -> str:
    """'; outside the download window until 22:00 UTC' when the agent says it waits."""
    for f in config.files:
        if _held(config, f):
            continue
        try:
            note = (Path(config.model_dir) / "waiting" / f.sha256).read_text().strip()
        except OSError:
            continue
        if note:
            return f"; {note}"
    return ""


def _recorded_failure(config: RuntimeConfig) -> PrewarmError | None:
    for f in config.files:
        try:
            line = (Path(config.model_dir) / "failed" / f.sha256).read_text()
        except OSError:
            continue
        parsed = reasons.parse_termination_message(line)
        if parsed is not None:
            return PrewarmError(f"{f.path}: {parsed[1]}", parsed[0])
    return None


def wait_for_cache(
    config: RuntimeConfig, out: TextIO, stop: threading.Event, interval_s: float = 1.0
) -> None:
    """Return once every file is in the cache; raise PrewarmError on a recorded failure or
    after `config.model_wait_seconds`."""
    deadline = time.monotonic() + config.model_wait_seconds
    next_say = 0.0
    while not all(_held(config, f) for f in config.files):
        if (failure := _recorded_failure(config)) is not None:
            raise failure
        done, total = _done_bytes(config), config.total_bytes()
        now = time.monotonic()
        if now >= deadline:
            raise PrewarmError(
                f"{done} of {total} bytes in the node cache after "
                f"{config.model_wait_seconds:.0f}s; the node agent is still fetching"
                f"{_waiting_note(config)}",
                reasons.MODEL_DOWNLOADING,
            )
        if now >= next_say:
            note = _waiting_note(config)
            out.write(f"prewarm: waiting for the node agent: {done} of {total} bytes{note}\n")
            out.flush()
            next_say = now + max(interval_s, 5.0)
        if stop.wait(min(interval_s, max(deadline - now, 0.01))):
            raise Interrupted()
    out.write("prewarm: all files are in the node cache\n")
    out.flush()
