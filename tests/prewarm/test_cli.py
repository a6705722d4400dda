"""The CLI as the init container runs it: a real subprocess on real files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from ember_runtime.contract import reasons
from ember_runtime.contract.config import ModelFile
from ember_runtime.contract.manifest import MANIFEST_NAME, read_manifest, resolve_model_path
from ember_runtime.prewarm.copy import PARTIAL_MARKER

from tests.prewarm.conftest import CLI, MakeSetup, run_cli
from tests.support.model import MODEL_FILENAME, MODEL_SHA256, MODEL_SIZE_BYTES

HALF_GIB = 1 << 29


def _partials(target: Path) -> list[Path]:
    return [p for p in target.rglob("*") if PARTIAL_MARKER in p.name]


def test_gemma_happy_path_then_reuse(make_setup: MakeSetup, gemma_path: Path) -> None:
    s = make_setup({MODEL_FILENAME: gemma_path, "tokenizer.json": b'{"v": 1}\n' * 1000})
    assert resolve_model_path(s.config) == s.model_dir / MODEL_FILENAME  # before: the source

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 0, done.stderr
    assert "MB/s" in done.stdout and "ETA" in done.stdout
    copied = s.target / MODEL_FILENAME
    assert copied.stat().st_size == MODEL_SIZE_BYTES
    assert hashlib.sha256(copied.read_bytes()).hexdigest() == MODEL_SHA256
    manifest = read_manifest(s.target)
    assert manifest is not None
    entries = {e.path: e for e in manifest.files}
    assert entries[MODEL_FILENAME].sha256 == MODEL_SHA256
    assert entries[MODEL_FILENAME].source_mtime_ns == gemma_path.stat().st_mtime_ns
    assert resolve_model_path(s.config) == copied
    assert not _partials(s.target)
    assert not s.termination_log.exists()

    before = copied.stat()
    again = run_cli("prewarm", "--config", s.config_path)

    assert again.returncode == 0, again.stderr
    assert "reusing" in again.stdout
    after = copied.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_config_is_copied_again(make_setup: MakeSetup) -> None:
    s = make_setup({"a.bin": os.urandom(3000)})
    assert run_cli("prewarm", "--config", s.config_path).returncode == 0
    inode = (s.target / "a.bin").stat().st_ino
    (s.model_dir / "a.bin").write_bytes(b"new bytes")
    s.write(
        s.config.model_copy(
            update={
                "files": [
                    ModelFile(
                        path="a.bin", sha256=hashlib.sha256(b"new bytes").hexdigest(), size_bytes=9
                    )
                ]
            }
        )
    )

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 0, done.stderr
    assert "reusing" not in done.stdout
    assert (s.target / "a.bin").read_bytes() == b"new bytes"
    assert (s.target / "a.bin").stat().st_ino != inode


def test_corrupted_byte_fails_with_reason(make_setup: MakeSetup) -> None:
    data = bytearray(os.urandom(5 << 20))
    s = make_setup({"model.gguf": bytes(data)})
    data[4_000_000] ^= 0xFF
    (s.model_dir / "model.gguf").write_bytes(data)
    got = hashlib.sha256(data).hexdigest()

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 1
    expected = s.config.files[0].sha256
    detail = f"model.gguf expected {expected[:12]}… got {got[:12]}…"
    assert s.termination_log.read_text() == f"ChecksumMismatch: {detail}\n"
    # What the operator reads back: the same vocabulary, the same format.
    assert reasons.parse_termination_message(s.termination_log.read_text()) == (
        reasons.CHECKSUM_MISMATCH,
        detail,
    )
    assert not (s.target / "model.gguf").exists()
    assert not _partials(s.target)
    assert not (s.target / MANIFEST_NAME).exists()
    assert resolve_model_path(s.config) == s.model_dir / "model.gguf"


def test_missing_file(make_setup: MakeSetup) -> None:
    s = make_setup({"model.gguf": b"x" * 100, "shard-2.gguf": b"y" * 100})
    (s.model_dir / "shard-2.gguf").unlink()

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 1
    assert s.termination_log.read_text() == (
        "ModelFileMissing: source files: missing file: shard-2.gguf\n"
    )
    assert not s.target.exists()  # nothing was created, let alone copied


def test_too_small_target_fails_before_copying(make_setup: MakeSetup) -> None:
    s = make_setup({"model.gguf": os.urandom(4 << 20)})

    done = run_cli(
        "prewarm",
        "--config",
        s.config_path,
        "--shm-limit-bytes",
        str(2 << 20),
        "--margin-bytes",
        "0",
    )

    assert done.returncode == 1
    reason = s.termination_log.read_text()
    assert reason.startswith(
        "SharedMemoryFull: shm free space: free 2.1 MB (sizeLimit), need 4.2 MB"
    )
    assert not s.target.exists()
    assert "MB/s" not in done.stdout  # no copy started


def test_termination_log_flag_and_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "modelName: x\nmodelDir: /m\nfiles: [{path: a, sha256: nothex, sizeBytes: 1}]\n"
    )
    log = tmp_path / "log"

    done = run_cli("prewarm", "--config", config, "--termination-log", log)

    assert done.returncode == 1
    assert log.read_text().startswith("ConfigInvalid: files.0.sha256: String should match pattern")


def test_unsafe_path_is_rejected(make_setup: MakeSetup) -> None:
    s = make_setup({"a.bin": b"a"})
    s.write(
        s.config.model_copy(
            update={"files": [s.config.files[0].model_copy(update={"path": "../../etc/passwd"})]}
        )
    )

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 1
    assert "unsafe path: ../../etc/passwd" in s.termination_log.read_text()


def test_diagnose_table_and_json(make_setup: MakeSetup) -> None:
    s = make_setup({"model.gguf": b"m" * 1000})

    table = run_cli("diagnose", "--config", s.config_path)
    as_json = run_cli("diagnose", "--config", s.config_path, "--json")

    assert table.returncode == 0, table.stdout + table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["check", "value", "detail"]
    assert any(line.startswith("✅ source files") and "1 files, 0.0 MB" in line for line in lines)
    assert lines[-1].startswith("OK: ") and lines[-1].endswith("0 failed")
    doc = json.loads(as_json.stdout)
    assert as_json.returncode == 0
    assert set(doc) == {"ok", "summary", "checks"}
    assert doc["ok"] is True
    assert set(doc["summary"]) == {"ok", "warn", "fail"}
    names = [c["name"] for c in doc["checks"]]
    assert names == [
        "source files",
        "file permissions",
        "target writable",
        "shm free space",
        "free memory",
        "cpu features",
    ]
    assert all(set(c) == {"name", "status", "value", "detail"} for c in doc["checks"])
    assert not s.target.exists()  # diagnose changes nothing on the node


def test_diagnose_failure_exit_code(make_setup: MakeSetup) -> None:
    s = make_setup({"model.gguf": b"m" * 1000}, accelerator="npu")
    (s.model_dir / "model.gguf").write_bytes(b"short")

    # A device root of our own, not the machine's /dev: an NPU node (or the e2e's fake device
    # nodes, left behind by a killed run) would pass the device check.
    dev = ("--dev-root", s.model_dir)
    table = run_cli("diagnose", "--config", s.config_path, *dev)
    doc = json.loads(run_cli("diagnose", "--config", s.config_path, *dev, "--json").stdout)

    assert table.returncode == 1
    assert "❌ source files" in table.stdout
    assert "size mismatch: model.gguf expected 1000 got 5" in table.stdout
    assert table.stdout.splitlines()[-1].startswith("FAIL: ")
    assert doc["ok"] is False
    statuses = {c["name"]: c["status"] for c in doc["checks"]}
    assert statuses["source files"] == "fail"
    assert statuses["npu devices"] == "fail"


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


def _start_and_wait_for_progress(config: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*CLI, "prewarm", "--config", str(config), "--progress-interval", "0.02"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:  # wait until bytes are flowing into the temp file
        if line.startswith("prewarm: ") and not line.startswith("prewarm: 0.0/"):
            return proc
        assert time.monotonic() < deadline
    raise AssertionError(f"no progress before exit: {proc.wait()} {proc.stderr.read()}")  # type: ignore[union-attr]


def test_sigterm_mid_copy_leaves_no_half_file(make_setup: MakeSetup) -> None:
    s = make_setup({"small.bin": b"s" * 10})
    # 1 GiB of holes: big enough to be mid-copy when the signal lands, cheap to create.
    _sparse(s.model_dir / "big.gguf", 1 << 30)
    big = ModelFile(path="big.gguf", sha256="0" * 64, size_bytes=1 << 30)
    s.write(s.config.model_copy(update={"files": [big, *s.config.files]}))
    proc = _start_and_wait_for_progress(s.config_path)

    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)

    assert rc == 128 + signal.SIGTERM
    assert s.termination_log.read_text() == "PrewarmInterrupted: prewarm interrupted by SIGTERM\n"
    assert not (s.target / "big.gguf").exists()
    assert not _partials(s.target)
    assert not (s.target / MANIFEST_NAME).exists()


def test_sigkill_mid_copy_then_rerun(make_setup: MakeSetup) -> None:
    s = make_setup({"small.bin": b"s" * 10})
    _sparse(s.model_dir / "big.gguf", HALF_GIB)
    holes = hashlib.sha256()
    zeros = bytes(1 << 20)
    for _ in range(HALF_GIB >> 20):
        holes.update(zeros)
    big = ModelFile(path="big.gguf", sha256=holes.hexdigest(), size_bytes=HALF_GIB)
    s.write(s.config.model_copy(update={"files": [big, *s.config.files]}))
    proc = _start_and_wait_for_progress(s.config_path)

    proc.kill()
    proc.wait(timeout=60)

    assert not (s.target / "big.gguf").exists()  # only a temp name can hold a half file
    assert _partials(s.target)
    assert resolve_model_path(s.config) == s.model_dir / "big.gguf"

    done = run_cli("prewarm", "--config", s.config_path)

    assert done.returncode == 0, done.stderr
    assert not _partials(s.target)
    assert (s.target / "big.gguf").stat().st_size == HALF_GIB
    assert resolve_model_path(s.config) == s.target / "big.gguf"
