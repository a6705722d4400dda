"""Small helpers for writes that must survive a crash or a power cut (prewarm's files and
manifest, the node agent's cache, the device plugin's checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """All of `data` to `fd`: `os.write` may take less (a full disk, a signal), never silently."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """`path` holds `data` after a crash or a power cut, or what it held before: never part of
    either (a temporary name beside it, fsync, rename, fsync the folder)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
