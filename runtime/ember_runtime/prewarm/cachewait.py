"""Wait for the node agent to put an http source's files into the node cache.

Prewarm mounts the cache read-only and never fetches: the agent on the node does, once for all
pods there. A final name under `sha256/` holds only verified bytes, so its presence is enough;
prewarm still hashes it again while copying. A download that failed for good is recorded by the
agent as a termination line under `failed/<digest>`, which prewarm reports as its own (so a wrong
sha256 shows as `ChecksumMismatch` on the InferenceDeployment).

A slow download is visible live: the node agent, which does the download, writes the pod's
`ember.dev/ModelDownload` condition as soon as it sees the pod wait and then every 30 s
(nodeagent/podprogress.py), and the operator shows it while this container runs. Prewarm
itself has no API access (it runs the replica author's image); it logs the bytes so far
(`kubectl logs -c prewarm`) and, after `model_wait_seconds` (30 minutes), exits with
`ModelDownloading` and a message naming its node, the bytes done of the total and an ETA (the
rate is what prewarm saw the cache grow by during this wait; the agent's condition says the same
in the same words: `contract.download`), e.g.

    node-a: 1.2 of 3.4 GB in the node cache, ETA 3m03s (12.0 MB/s over 1m40s)

and the kubelet starts it again. Before the agent reported, prewarm's first wait lasted one
minute so that this exit would say something soon; it no longer restarts for that.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TextIO

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import VIEW_FAILED, VIEW_WAITING, entry_size, partial_name
from ember_runtime.contract.config import ModelFile, RuntimeConfig
from ember_runtime.contract.download import Observation, progress_message
from ember_runtime.prewarm.errors import Interrupted, PrewarmError

NODE_ENV = "NODE_NAME"  # the downward API's spec.nodeName, in every Ember pod's env


def _held(config: RuntimeConfig, f: ModelFile) -> bool:
    return entry_size(config.source_file(f)) == f.size_bytes


def _done_bytes(config: RuntimeConfig) -> int:
    """Bytes on the node so far: whole files plus the agent's partials (stat needs no read)."""
    total = 0
    for f in config.files:
        final = config.source_file(f)
        partial = final.with_name(partial_name(final.name))
        total += f.size_bytes if _held(config, f) else min(entry_size(partial), f.size_bytes)
    return total


def _beside(config: RuntimeConfig, f: ModelFile, name: str) -> Path:
    """A line the agent keeps in the digest's view, next to `data` (`failed`, `waiting`)."""
    return config.source_file(f).with_name(name)


def _waiting_note(config: RuntimeConfig) -> str:
    """'; outside the download window until 22:00 UTC' when the agent says it waits."""
    for f in config.files:
        if _held(config, f):
            continue
        try:
            note = _beside(config, f, VIEW_WAITING).read_text().strip()
        except OSError:
            continue
        if note:
            return f"; {note}"
    return ""


def _recorded_failure(config: RuntimeConfig) -> PrewarmError | None:
    for f in config.files:
        try:
            line = _beside(config, f, VIEW_FAILED).read_text()
        except OSError:
            continue
        parsed = reasons.parse_termination_message(line)
        if parsed is not None:
            return PrewarmError(f"{f.path}: {parsed[1]}", parsed[0])
    return None


def wait_seconds(config: RuntimeConfig) -> float:
    """This run's wait before it exits with ModelDownloading."""
    return config.model_wait_seconds


def wait_for_cache(
    config: RuntimeConfig,
    out: TextIO,
    stop: threading.Event,
    interval_s: float = 1.0,
    node: str | None = None,
) -> None:
    """Return once every file is in the cache; raise PrewarmError on a recorded failure or,
    with ModelDownloading and the progress, after this run's wait (`wait_seconds`)."""
    node = node or os.environ.get(NODE_ENV) or "this node"
    total = config.total_bytes()
    if all(_held(config, f) for f in config.files):
        _done(config, out)
        return
    wait = wait_seconds(config)
    first = Observation(time.monotonic(), _done_bytes(config))
    deadline = first.at + wait
    next_say = 0.0
    while not all(_held(config, f) for f in config.files):
        if (failure := _recorded_failure(config)) is not None:
            raise failure
        now = Observation(time.monotonic(), _done_bytes(config))
        if now.at >= deadline:
            note = _waiting_note(config)
            raise PrewarmError(
                progress_message(node, first, now, total, note), reasons.MODEL_DOWNLOADING
            )
        if now.at >= next_say:
            note = _waiting_note(config)
            out.write(f"prewarm: waiting for the node agent: {now.done} of {total} bytes{note}\n")
            out.flush()
            next_say = now.at + max(interval_s, 5.0)
        if stop.wait(min(interval_s, max(deadline - now.at, 0.01))):
            raise Interrupted()
    _done(config, out)


def _done(config: RuntimeConfig, out: TextIO) -> None:
    out.write("prewarm: all files are in the node cache\n")
    out.flush()
