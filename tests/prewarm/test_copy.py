"""Hash-while-copy, in process: failures injected mid-stream, parallel files, progress."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path

import pytest
from ember_runtime.contract.config import ModelFile
from ember_runtime.contract.manifest import MANIFEST_NAME, read_manifest
from ember_runtime.prewarm.checks import Preflight
from ember_runtime.prewarm.copy import CopyOptions, copy_all, copy_verified, remove_partials
from ember_runtime.prewarm.errors import ChecksumMismatch, Interrupted, PrewarmError, SizeMismatch
from ember_runtime.prewarm.progress import Progress
from ember_runtime.prewarm.run import prewarm

from tests.prewarm.conftest import MakeSetup

SMALL = CopyOptions(buffer_bytes=64 << 10, parallel=3)


class StopAfter(Progress):
    """Progress that trips the stop event after `limit` bytes: a SIGTERM at a known point."""

    def __init__(self, total: int, limit: int, stop: threading.Event) -> None:
        super().__init__(total, io.StringIO())
        self.limit, self.stop = limit, stop

    def add(self, nbytes: int) -> None:
        super().add(nbytes)
        if self.done_bytes >= self.limit:
            self.stop.set()


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_parallel_files_in_subdirectories(make_setup: MakeSetup) -> None:
    files = {f"shards/part-{i}.gguf": os.urandom(300_000 + i) for i in range(5)}
    s = make_setup({**files, "empty.txt": b""})
    out = io.StringIO()

    manifest = prewarm(Preflight(s.config), SMALL, out, threading.Event())

    for rel, data in files.items():
        assert (s.target / rel).read_bytes() == data
    assert (s.target / "empty.txt").read_bytes() == b""
    assert {e.path for e in manifest.files} == {*files, "empty.txt"}
    assert read_manifest(s.target) == manifest
    assert "preflight ✅ shm free space" in out.getvalue()
    assert out.getvalue().splitlines()[-2].startswith("prewarm: 1.5/1.5 MB (100.0%)")


def test_stop_mid_copy_removes_temp(make_setup: MakeSetup) -> None:
    s = make_setup({"big.bin": os.urandom(4 << 20)})
    s.target.mkdir(parents=True)
    stop = threading.Event()
    progress = StopAfter(4 << 20, 1 << 20, stop)

    with pytest.raises(Interrupted):
        copy_verified(
            s.model_dir, s.target, s.config.files[0], progress=progress, stop=stop, options=SMALL
        )

    assert 1 << 20 <= progress.done_bytes < 4 << 20
    assert _listing(s.target) == []


def test_one_failure_stops_the_siblings(make_setup: MakeSetup) -> None:
    s = make_setup({"a.bin": os.urandom(2 << 20), "b.bin": os.urandom(2 << 20), "c.bin": b"c"})
    bad = s.config.files[2].model_copy(update={"sha256": "f" * 64})
    s.target.mkdir(parents=True)

    with pytest.raises(ChecksumMismatch, match=r"^c.bin expected ffffffffffff…"):
        copy_all(
            s.model_dir,
            s.target,
            [*s.config.files[:2], bad],
            progress=Progress(1, io.StringIO()),
            stop=threading.Event(),
            options=SMALL,
        )

    assert not any(".partial-" in name for name in _listing(s.target))
    assert "c.bin" not in _listing(s.target)


def test_source_longer_or_shorter_than_config(make_setup: MakeSetup) -> None:
    s = make_setup({"m.bin": b"0123456789"})
    s.target.mkdir(parents=True)
    spec = s.config.files[0]
    progress = Progress(10, io.StringIO())
    longer = spec.model_copy(update={"size_bytes": 4})
    with pytest.raises(SizeMismatch, match=r"^m\.bin expected 4 bytes got 10"):
        copy_verified(
            s.model_dir,
            s.target,
            longer,
            progress=progress,
            stop=threading.Event(),
            options=CopyOptions(2),
        )
    shorter = spec.model_copy(update={"size_bytes": 20})
    with pytest.raises(SizeMismatch, match="expected 20 bytes got 10"):
        copy_verified(
            s.model_dir, s.target, shorter, progress=progress, stop=threading.Event(), options=SMALL
        )
    assert _listing(s.target) == []


def test_missing_source_during_copy(make_setup: MakeSetup) -> None:
    s = make_setup({"m.bin": b"x"})
    s.target.mkdir(parents=True)
    gone = ModelFile(path="gone.bin", sha256="0" * 64, size_bytes=1)
    with pytest.raises(PrewarmError, match=r"^missing file: gone.bin"):
        copy_verified(
            s.model_dir,
            s.target,
            gone,
            progress=Progress(1, io.StringIO()),
            stop=threading.Event(),
            options=SMALL,
        )


def test_digest_matches_hashlib_across_buffer_sizes(make_setup: MakeSetup) -> None:
    data = os.urandom(1_000_003)  # not a multiple of any buffer size
    s = make_setup({"m.bin": data})
    s.target.mkdir(parents=True)
    for buffer_bytes in (4093, 1 << 16, 1 << 20, 4 << 20):
        entry = copy_verified(
            s.model_dir,
            s.target,
            s.config.files[0],
            progress=Progress(len(data), io.StringIO()),
            stop=threading.Event(),
            options=CopyOptions(buffer_bytes=buffer_bytes),
        )
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
        assert (s.target / "m.bin").read_bytes() == data


def test_rerun_after_crash_clears_partials_and_stale_manifest(make_setup: MakeSetup) -> None:
    s = make_setup({"m.bin": b"new"})
    s.target.mkdir(parents=True)
    (s.target / ".m.bin.partial-12345").write_bytes(b"half")
    (s.target / MANIFEST_NAME).write_text("{not json")

    prewarm(Preflight(s.config), SMALL, io.StringIO(), threading.Event())

    assert _listing(s.target) == [MANIFEST_NAME, "m.bin"]
    assert remove_partials(s.target) == 0


def test_progress_line_format() -> None:
    now = [100.0]
    progress = Progress(200_000_000, io.StringIO(), clock=lambda: now[0])
    progress.add(50_000_000)
    now[0] = 102.0
    assert progress.line() == "prewarm: 50.0/200.0 MB (25.0%) 25.0 MB/s ETA 6.0s"
