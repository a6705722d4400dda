"""Prewarm's side of the manifest (`contract.manifest`): written last and durably, removed
first.
"""

from __future__ import annotations

from pathlib import Path

from ember_runtime.contract.manifest import MANIFEST_NAME, Manifest, encode_manifest
from ember_runtime.durable import fsync_dir, replace_file


def write_manifest(target_dir: Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temp name, fsync, rename, fsync the directory)."""
    replace_file(target_dir / MANIFEST_NAME, encode_manifest(manifest))


def remove_manifest(target_dir: Path) -> None:
    """Invalidate the target before touching its files, so no reader trusts a half-updated set."""
    (target_dir / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(target_dir)
