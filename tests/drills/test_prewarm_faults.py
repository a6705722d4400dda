"""Drill 5: prewarm (the init container's CLI, a real subprocess) on the packaged Gemma file made
truncated or corrupt, and on a real memory-backed volume (a tmpfs mounted here, as root) that is
too small or fills up while the model is being copied into it.

Each case must end with exit 1 and one `Reason: detail` line in the termination log that names
what is wrong (the operator shows it as the Degraded reason), and leave nothing half-written in
the target: no model file under its final name, no `.partial-` temp, no manifest. Cases that
strike between the preflight checks and the copy (the file shrinks, the volume fills) pause
prewarm right there: its stdout is a pipe filled beforehand, and its first line is written only
after every check has run, so it blocks until the drill has done its damage and drains the pipe.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.config import ModelFile, RuntimeConfig
from ember_runtime.contract.manifest import MANIFEST_NAME
from ember_runtime.prewarm.checks import DEFAULT_MARGIN_BYTES
from ember_runtime.prewarm.copy import PARTIAL_MARKER

from tests.drills.common import record, scale, table
from tests.support.model import MODEL_FILENAME, MODEL_SHA256, MODEL_SIZE_BYTES, default_model_path
from tests.support.waiting import wait_for

CLI = [sys.executable, "-m", "ember_runtime.prewarm", "prewarm"]
MIB = 1 << 20
NEED = MODEL_SIZE_BYTES + DEFAULT_MARGIN_BYTES  # what the space check asks of the volume
Damage = Callable[[Path, Path], None]  # (the source file, the tmpfs mount) -> None


def _mount_tmpfs(path: Path, size_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)]
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A real memory-backed volume of `size_bytes`, like the pod's emptyDir medium=Memory."""
    if os.geteuid() != 0:
        pytest.fail("drill 5 mounts a tmpfs: run it as root (the suite's cluster runs need root)")
    _mount_tmpfs(path, size_bytes)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _full_pipe() -> tuple[int, int]:
    """A pipe with no room left: the next write to it blocks until the reader reads."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for chunk in (b"\0" * 4096, b"\0"):
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, chunk)
    os.set_blocking(w, True)  # the child inherits the flag; it must block, not fail
    return r, w


def _blocked_on_pipe(pid: int) -> bool:
    wchan = Path(f"/proc/{pid}/wchan").read_text()
    return "pipe_write" in wchan  # anon_pipe_write or pipe_write, by kernel version


def run_prewarm(config: Path, between: Damage | None, source: Path, mount: Path) -> int:
    """The CLI to its end; `between` runs after its preflight checks and before its copy."""
    if between is None:
        argv = [*CLI, "--config", str(config)]
        return subprocess.run(argv, capture_output=True, check=False).returncode
    r, w = _full_pipe()
    proc = subprocess.Popen([*CLI, "--config", str(config)], stdout=w, stderr=subprocess.DEVNULL)
    os.close(w)

    def blocked() -> bool:
        if _blocked_on_pipe(proc.pid):
            return True
        assert proc.poll() is None, "prewarm ended before its first line"
        return False

    wait_for("prewarm past its preflight checks (blocked on its full pipe)", blocked, 60, 0.01)
    between(source, mount)
    drain = threading.Thread(target=lambda: _drain(r), daemon=True)
    drain.start()
    code = proc.wait(120)
    drain.join(10)
    return code


def _drain(fd: int) -> None:
    with os.fdopen(fd, "rb") as pipe:
        while pipe.read(1 << 16):
            pass


# --- the damage ----------------------------------------------------------------------------
def write_truncated(source: Path, size: int) -> None:
    with default_model_path().open("rb") as src, source.open("wb") as dst:
        remaining = size
        while remaining and (buf := src.read(min(remaining, 8 * MIB))):
            dst.write(buf)
            remaining -= len(buf)


def write_corrupted(source: Path, offset: int) -> None:
    write_truncated(source, MODEL_SIZE_BYTES)
    with source.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def link_intact(source: Path) -> None:
    source.symlink_to(default_model_path())  # the model volume is read, never written


def truncate_now(size: int) -> Damage:
    def damage(source: Path, mount: Path) -> None:
        os.truncate(source, size)

    return damage


def fill_volume(source: Path, mount: Path) -> None:
    """Another writer takes every free byte of the volume (another container, a log)."""
    chunk = b"\0" * MIB
    with (mount / "filler").open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    # A partial last chunk may leave less than a page; fill that too.
    with contextlib.suppress(OSError), (mount / "filler-tail").open("wb", buffering=0) as f:
        while True:
            f.write(b"\0")


@dataclass(frozen=True)
class Case:
    name: str
    expect: str  # the reason the termination log must carry
    volume_bytes: int = NEED + 16 * MIB
    prepare: Callable[[Path], None] = link_intact  # writes the source file
    between: Damage | None = None  # strikes after the preflight checks, before the copy


def truncated(size: int) -> Callable[[Path], None]:
    return lambda source: write_truncated(source, size)


def corrupted(offset: int) -> Callable[[Path], None]:
    return lambda source: write_corrupted(source, offset)


def cases() -> list[Case]:
    size, half, last = MODEL_SIZE_BYTES, MODEL_SIZE_BYTES // 2, MODEL_SIZE_BYTES - 1
    mismatch, checksum, full = (
        reasons.SIZE_MISMATCH,
        reasons.CHECKSUM_MISMATCH,
        reasons.SHARED_MEMORY_FULL,
    )
    short = [
        Case("truncated to half", mismatch, prepare=truncated(half)),
        Case("one byte flipped mid-file", checksum, prepare=corrupted(half)),
        Case(
            "truncated during the copy",
            mismatch,
            prepare=truncated(size),
            between=truncate_now(half),
        ),
        Case("volume of 50 MiB", full, volume_bytes=50 * MIB),
        Case("volume filled during the copy", full, between=fill_volume),
    ]
    if scale() == "short":
        return short
    return [
        *short,
        Case("truncated to 0 bytes", mismatch, prepare=truncated(0)),
        Case("truncated to its first 4 KiB", mismatch, prepare=truncated(4096)),
        Case("one byte short", mismatch, prepare=truncated(last)),
        Case("first byte flipped", checksum, prepare=corrupted(0)),
        Case("last byte flipped", checksum, prepare=corrupted(last)),
        Case(
            "one byte short during the copy",
            mismatch,
            prepare=truncated(size),
            between=truncate_now(last),
        ),
        Case("volume 1 MiB smaller than needed", full, volume_bytes=NEED - MIB),
    ]


@dataclass(frozen=True)
class Result:
    code: int
    message: str  # the termination log
    leftovers: list[str]  # what the target holds afterwards (must be nothing)

    def reason(self) -> str | None:
        parsed = reasons.parse_termination_message(self.message)
        return parsed[0] if parsed else None


def run_case(case: Case, work: Path) -> Result:
    models, mount = work / "models", work / "shm"
    models.mkdir(parents=True)
    source = models / MODEL_FILENAME
    case.prepare(source)
    log, config_path = work / "termination-log", work / "config.yaml"
    spec = ModelFile(path=MODEL_FILENAME, sha256=MODEL_SHA256, size_bytes=MODEL_SIZE_BYTES)
    config = RuntimeConfig.model_validate(
        {
            "model_name": "gemma-3-270m",
            "model_dir": str(models),
            "files": [spec],
            "prewarm_dir": str(mount / "model"),
            "termination_log": str(log),
        }
    )
    config_path.write_text(config.to_yaml())
    with tmpfs(mount, case.volume_bytes):
        code = run_prewarm(config_path, case.between, source, mount)
        target = mount / "model"
        leftovers = sorted(
            str(p.relative_to(target))
            for p in (target.rglob("*") if target.is_dir() else [])
            if p.name in (MODEL_FILENAME, MANIFEST_NAME) or PARTIAL_MARKER in p.name
        )
    message = log.read_text() if log.exists() else ""
    return Result(code, message, leftovers)


def test_prewarm_on_broken_files_and_a_full_volume(tmp_path: Path) -> None:
    results = {case: run_case(case, tmp_path / str(i)) for i, case in enumerate(cases())}
    rows: list[tuple[str, Any]] = [
        (case.name, f"exit {r.code}, `{r.message.strip()}`, leftovers {r.leftovers or 'none'}")
        for case, r in results.items()
    ]
    print(f"\nprewarm on broken files and a full volume ({scale()})\n{table(rows)}")
    wrong = {
        case.name: (r.code, r.message, r.leftovers)
        for case, r in results.items()
        if r.code != 1 or r.reason() != case.expect or r.leftovers
    }
    if scale() == "full":
        record("prewarm on broken files and a full volume", {"wrong": wrong}, rows)
    assert not wrong, wrong
