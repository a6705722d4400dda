"""The prewarm sequence: preflight, reuse or copy, manifest."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TextIO

from ember_runtime.contract.manifest import Manifest, read_manifest
from ember_runtime.prewarm.cachewait import wait_for_cache
from ember_runtime.prewarm.checks import Preflight, failures, run_checks
from ember_runtime.prewarm.copy import CopyOptions, copy_all, remove_partials
from ember_runtime.prewarm.errors import PrewarmError
from ember_runtime.prewarm.manifest import remove_manifest, write_manifest
from ember_runtime.prewarm.progress import Progress
from ember_runtime.prewarm.report import ICONS


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


def prewarm(
    pf: Preflight,
    options: CopyOptions,
    out: TextIO,
    stop: threading.Event,
    progress_interval_s: float = 1.0,
) -> Manifest:
    """Leave `pf.target` holding the verified model and its manifest, or raise PrewarmError."""
    target = pf.target
    if target is None:
        raise PrewarmError("prewarmDir is not set (config prewarmDir or --prewarm-dir)")
    if pf.config.model_layout == "sha256":
        # The node agent fetches an http source's files; wait until all are in its cache.
        wait_for_cache(pf.config, out, stop, progress_interval_s)
    results = run_checks(pf)
    for r in results:
        _say(out, f"preflight {ICONS[r.status]} {r.name}: {r.value}")
    if failed := failures(results):
        # Nothing has been copied or deleted yet: the node is as we found it.
        raise PrewarmError(f"{failed[0].name}: {failed[0].value}", failed[0].reason)
    if pf.reusable():
        manifest = read_manifest(target)
        if manifest is not None:  # it could vanish between the two reads; then copy again
            _say(out, f"prewarm: reusing verified copy in {target}")
            return manifest
    target.mkdir(parents=True, exist_ok=True)
    # Invalidate first, then clear what this run replaces, so the space check's arithmetic
    # holds and no reader ever trusts a mix of old and new files.
    remove_manifest(target)
    remove_partials(target)
    for f in pf.config.files:
        (target / f.path).unlink(missing_ok=True)
    with Progress(pf.config.total_bytes(), out, progress_interval_s) as progress:
        entries = copy_all(
            Path(pf.config.model_dir),
            target,
            list(pf.config.files),
            progress=progress,
            stop=stop,
            options=options,
            locate=pf.config.source_file,
        )
    manifest = Manifest(
        model_name=pf.config.model_name, engine_kind=pf.config.engine.kind, files=entries
    )
    write_manifest(target, manifest)
    _say(out, f"prewarm: {len(entries)} files verified in {target}")
    return manifest
