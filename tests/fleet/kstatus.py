"""kstatus (sigs.k8s.io/cli-utils) from Python: the Go harness in tests/fleet/kstatus/, built once.

The binary is cached by the content of its sources, at
`~/.cache/ember/kstatus/<sha256 of go.mod, go.sum, main.go>/kstatus` ($XDG_CACHE_HOME is
honoured), so a second run, or a second test process, starts it without compiling. The first
build (≈50 s on 2 cores, dependencies from the Go module proxy) runs under a file lock: parallel
test processes wait for the one that builds, and a half-written binary is never seen (it is
renamed into place when complete).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "kstatus"
FILES = ("go.mod", "go.sum", "main.go")
STATUSES = frozenset({"InProgress", "Current", "Failed", "Terminating", "Unknown"})


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember" / "kstatus"


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in FILES:
        digest.update(name.encode() + b"\0" + (SOURCE / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def binary() -> Path:
    """The harness for the sources as they are now, built if this content never was."""
    out = _cache_root() / source_hash() / "kstatus"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():  # another process may have built it while this one waited
            _build(out)
    return out


def _build(out: Path) -> None:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("kstatus harness: no `go` on PATH (Go >= 1.22 is needed)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # Built from a copy, so that -mod=mod never rewrites go.mod/go.sum in the checkout.
        for name in FILES:
            shutil.copy2(SOURCE / name, Path(tmp) / name)
        env = {**os.environ, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
        env.setdefault("GOPROXY", "https://proxy.golang.org,direct")
        built = Path(tmp) / "kstatus"
        proc = subprocess.run(
            [go, "build", "-trimpath", "-o", str(built), "."],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kstatus harness: go build failed:\n{proc.stderr}")
        built.replace(out)


def compute(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kstatus's `status.Compute` for each object: [{name, status, message}], in order."""
    proc = subprocess.run(
        [str(binary())],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kstatus harness failed: {proc.stderr.strip()}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    if len(results) != len(objects):
        raise RuntimeError(f"kstatus harness: {len(objects)} objects, {len(results)} answers")
    for result in results:
        if result.get("status") not in STATUSES:
            raise RuntimeError(f"kstatus harness: unexpected answer {result}")
    return results
