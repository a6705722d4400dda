"""Copy model files into the memory-backed target while hashing them: one read of the source.

Per file, the calling thread reads a buffer from the source and writes it to a hidden temp file
next to the final name, then hands the same buffer to a hasher thread, so hashing (the slow
part) overlaps the next read and write on another core. hashlib, `readv` and `write` all
release the GIL for large buffers, so the two threads really run at once. Only after the size
and digest match is the temp file fsynced and renamed over the final name: a reader never sees
a half file there, whatever kills us (a SIGKILL leaves a `.partial-` file that the next run
removes).
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ember_runtime.contract import reasons
from ember_runtime.contract.config import ModelFile
from ember_runtime.contract.manifest import ManifestEntry
from ember_runtime.durable import fsync_dir, write_all
from ember_runtime.prewarm.errors import ChecksumMismatch, Interrupted, PrewarmError, SizeMismatch
from ember_runtime.prewarm.progress import Progress

PARTIAL_MARKER = ".partial-"
# Measured on a 16-core H200 host, 2 GiB cold: 1 MiB 1190 MB/s, 4 MiB 1162, 256 KiB 1095
# (cp: 1334). No posix_fallocate: on tmpfs it zeroes every page first (-15%), and the
# preflight space check already fails early.
DEFAULT_BUFFER_BYTES = 1 << 20
BUFFERS_PER_FILE = 4
DEFAULT_PARALLEL = 2

Locate = Callable[[ModelFile], Path]


@dataclass(frozen=True)
class CopyOptions:
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    parallel: int = DEFAULT_PARALLEL


def partial_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{PARTIAL_MARKER}{os.getpid()}")


def remove_partials(target_dir: Path) -> int:
    """Delete temp files left by a killed run; returns how many."""
    removed = 0
    for path in target_dir.rglob(f".*{PARTIAL_MARKER}*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class _Hasher:
    """A thread that hashes buffers in order and returns them to the pool."""

    def __init__(self, buffer_bytes: int) -> None:
        self.digest = hashlib.sha256()
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(BUFFERS_PER_FILE):
            self.free.put(bytearray(buffer_bytes))
        self._work: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="prewarm-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            buf, n = item
            self.digest.update(memoryview(buf)[:n])
            self.free.put(buf)

    def submit(self, buf: bytearray, n: int) -> None:
        self._work.put((buf, n))

    def finish(self) -> str:
        self._work.put(None)
        self._thread.join()
        return self.digest.hexdigest()


@contextmanager
def _temp_file(final: Path) -> Iterator[tuple[Path, int]]:
    """A fresh temp file next to `final`; unlinked unless the caller renamed it."""
    tmp = partial_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        yield tmp, fd
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)


def _stream(
    src_fd: int,
    dst_fd: int,
    spec: ModelFile,
    *,
    hasher: _Hasher,
    progress: Progress,
    stop: threading.Event,
) -> int:
    """Read `src_fd` into `dst_fd` and the hasher; returns the number of bytes copied."""
    copied = 0
    while True:
        if stop.is_set():
            raise Interrupted()
        buf = hasher.free.get()
        n = os.readv(src_fd, [buf])
        if n == 0:
            hasher.free.put(buf)
            return copied
        copied += n
        if copied > spec.size_bytes:
            hasher.free.put(buf)
            raise SizeMismatch(spec.path, spec.size_bytes, os.fstat(src_fd).st_size)
        write_all(dst_fd, memoryview(buf)[:n])
        hasher.submit(buf, n)
        progress.add(n)


def _copy_checked(
    src_fd: int,
    dst_fd: int,
    spec: ModelFile,
    *,
    progress: Progress,
    stop: threading.Event,
    options: CopyOptions,
) -> str:
    """Stream the whole file, then check its size and digest; returns the sha256."""
    hasher = _Hasher(options.buffer_bytes)
    try:
        copied = _stream(src_fd, dst_fd, spec, hasher=hasher, progress=progress, stop=stop)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise PrewarmError(
                f"no space left on target while writing {spec.path}", reasons.SHARED_MEMORY_FULL
            ) from err
        raise
    finally:
        digest = hasher.finish()
    if copied != spec.size_bytes:
        raise SizeMismatch(spec.path, spec.size_bytes, copied)
    if digest != spec.sha256:
        raise ChecksumMismatch(spec.path, spec.sha256, digest)
    return digest


def copy_verified(
    source_dir: Path,
    target_dir: Path,
    spec: ModelFile,
    *,
    progress: Progress,
    stop: threading.Event,
    options: CopyOptions,
    locate: Locate | None = None,
) -> ManifestEntry:
    """Copy one file, verify its size and sha256, and rename it into place. `locate` maps a
    file to its source path (default: `source_dir/<path>`; the node cache names by digest)."""
    final = target_dir / spec.path
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        src_fd = os.open(locate(spec) if locate else source_dir / spec.path, os.O_RDONLY)
    except FileNotFoundError as err:
        raise PrewarmError(
            f"missing file: {spec.path} (not found under {source_dir})", reasons.MODEL_FILE_MISSING
        ) from err
    try:
        mtime_ns = os.fstat(src_fd).st_mtime_ns
        os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with _temp_file(final) as (tmp, dst_fd):
            digest = _copy_checked(
                src_fd, dst_fd, spec, progress=progress, stop=stop, options=options
            )
            os.fsync(dst_fd)
            os.replace(tmp, final)
        # The verified bytes now live in shared memory; the source's page-cache copy would
        # only double the model's memory footprint on a small node.
        os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(src_fd)
    return ManifestEntry(
        path=spec.path, size_bytes=spec.size_bytes, sha256=digest, source_mtime_ns=mtime_ns
    )


def copy_all(
    source_dir: Path,
    target_dir: Path,
    files: list[ModelFile],
    *,
    progress: Progress,
    stop: threading.Event,
    options: CopyOptions,
    locate: Locate | None = None,
) -> list[ManifestEntry]:
    """Copy `files` with up to `options.parallel` at once; the first failure stops the rest."""
    if not files:
        return []
    workers = max(1, min(options.parallel, len(files)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prewarm-copy") as pool:
        futures = [
            pool.submit(
                copy_verified,
                source_dir,
                target_dir,
                f,
                progress=progress,
                stop=stop,
                options=options,
                locate=locate,
            )
            for f in files
        ]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception() is not None]
        if failed:
            stop.set()  # the other copies abort at their next buffer and remove their temps
            wait(futures)
            raise _first_cause([f.exception() for f in failed])
        entries = [f.result() for f in futures]
    for directory in {(target_dir / f.path).parent for f in files}:
        fsync_dir(directory)
    return entries


def _first_cause(errors: list[BaseException | None]) -> BaseException:
    """The failure that started it, not the Interrupted it caused in its siblings."""
    real = [e for e in errors if e is not None and not isinstance(e, Interrupted)]
    return (real or [e for e in errors if e is not None])[0]
