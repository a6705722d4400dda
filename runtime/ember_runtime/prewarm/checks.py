"""Node preflight: the checks `prewarm` runs before copying and `diagnose` prints.

Each check returns ok / warn / fail with the value it measured, so a failed pod says *why*
("shm free 200.0 MB < need 285.1 MB"), not just that it failed. Hardware is read through
roots (`/proc`, `/dev`, the cgroup mount) and a `GpuProbe`, all replaceable, so tests point
them at fake trees and a fake `nvidia-smi` while running this same code.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Protocol

from ember_runtime import vocabulary
from ember_runtime.contract import reasons
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.manifest import manifest_matches
from ember_runtime.gguf_header import GGUFHeaderError
from ember_runtime.prewarm.copy import PARTIAL_MARKER

DEFAULT_MARGIN_BYTES = 32 << 20
NVIDIA_SMI_TIMEOUT_S = 10.0
NPU_DEVICE_NODES = ("davinci_manager", "devmm_svm", "hisi_hdc")
NPU_ENV = ("ASCEND_DEVICE_ID", "ACL_CONTEXT_ID")


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    value: str
    detail: str = ""
    reason: str = reasons.PREFLIGHT_FAILED  # the Degraded reason when this check fails


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    driver_version: str
    cuda_version: str
    memory_free_bytes: int
    memory_total_bytes: int


class ProbeError(Exception):
    """The probe could not read the hardware; the message says what was missing."""


class GpuProbe(Protocol):
    def query(self) -> list[GpuInfo]: ...


@dataclass(frozen=True)
class NvidiaSmiProbe:
    """Reads GPUs through `nvidia-smi`, which ships with every NVIDIA driver."""

    binary: str = "nvidia-smi"

    def query(self) -> list[GpuInfo]:
        exe = shutil.which(self.binary)
        if exe is None:
            raise ProbeError(f"{self.binary} not found (NVIDIA driver not installed?)")
        fields = "index,name,driver_version,memory.free,memory.total"
        rows = self._run(exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits")
        # The CUDA version the driver supports is only printed in the banner.
        match = re.search(r"CUDA Version:\s*([0-9.]+)", self._run(exe))
        cuda = match.group(1) if match else "unknown"
        return [_parse_gpu_row(line, cuda) for line in rows.splitlines() if line.strip()]

    @staticmethod
    def _run(exe: str, *args: str) -> str:
        try:
            done = subprocess.run(
                [exe, *args],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ProbeError(f"nvidia-smi failed: {err}") from err
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().splitlines()
            raise ProbeError(f"nvidia-smi exit {done.returncode}: {reason[0] if reason else ''}")
        return done.stdout


def _parse_gpu_row(line: str, cuda: str) -> GpuInfo:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        raise ProbeError(f"unexpected nvidia-smi line: {line!r}")
    try:
        return GpuInfo(
            index=int(parts[0]),
            name=parts[1],
            driver_version=parts[2],
            cuda_version=cuda,
            memory_free_bytes=int(parts[3]) << 20,
            memory_total_bytes=int(parts[4]) << 20,
        )
    except ValueError as err:
        raise ProbeError(f"unexpected nvidia-smi line: {line!r}") from err


@dataclass(frozen=True)
class Host:
    """Where the checks look. Defaults read this machine; tests pass temp trees."""

    proc: Path = Path("/proc")
    dev: Path = Path("/dev")
    cgroup: Path = Path("/sys/fs/cgroup")
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    machine: str = field(default_factory=platform.machine)
    gpu: GpuProbe = field(default_factory=NvidiaSmiProbe)


@dataclass(frozen=True)
class Preflight:
    config: RuntimeConfig
    host: Host = field(default_factory=Host)
    shm_limit_bytes: int | None = None  # the emptyDir sizeLimit: statvfs cannot see it
    margin_bytes: int = DEFAULT_MARGIN_BYTES

    @property
    def target(self) -> Path | None:
        return Path(self.config.prewarm_dir) if self.config.prewarm_dir else None

    def reusable(self) -> bool:
        return self.target is not None and manifest_matches(self.config, self.target)


def _mb(n: int | float) -> str:
    return f"{n / 1e6:.1f} MB"


def unsafe_paths(config: RuntimeConfig) -> list[str]:
    """File paths that would escape the model or target directory."""
    bad = []
    for f in config.files:
        p = PurePosixPath(f.path)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            bad.append(f.path)
    return bad


def check_source_files(pf: Preflight) -> CheckResult:
    name = "source files"
    if not pf.config.files:
        return CheckResult(name, Status.FAIL, "no files listed in config")
    if bad := unsafe_paths(pf.config):
        return CheckResult(name, Status.FAIL, f"unsafe path: {bad[0]}", "paths must be relative")
    root = Path(pf.config.model_dir)
    for f in pf.config.files:
        try:
            size = pf.config.source_file(f).stat().st_size
        except FileNotFoundError:
            return CheckResult(
                name,
                Status.FAIL,
                f"missing file: {f.path}",
                f"under {root}",
                reasons.MODEL_FILE_MISSING,
            )
        except OSError as err:
            return CheckResult(name, Status.FAIL, f"cannot stat {f.path}: {err.strerror}")
        if size != f.size_bytes:
            value = f"size mismatch: {f.path} expected {f.size_bytes} got {size}"
            return CheckResult(name, Status.FAIL, value, reason=reasons.SIZE_MISMATCH)
    total = pf.config.total_bytes()
    return CheckResult(name, Status.OK, f"{len(pf.config.files)} files, {_mb(total)}")


def check_draft_model(pf: Preflight) -> CheckResult:
    """A draft model speaks the served model's vocabulary (engines/draft.py says why)."""
    name = "draft model"
    draft = pf.config.draft_file()
    if draft is None:
        return CheckResult(name, Status.OK, "none configured")
    served = pf.config.source_file(pf.config.files[0])
    try:
        why = vocabulary.difference(served, pf.config.source_file(draft))
    except (OSError, GGUFHeaderError) as err:
        return CheckResult(name, Status.FAIL, f"cannot read {draft.path}'s vocabulary: {err}")
    if why is not None:
        return CheckResult(name, Status.FAIL, why, reason=reasons.DRAFT_VOCABULARY_MISMATCH)
    return CheckResult(name, Status.OK, f"{draft.path}: the same vocabulary")


def check_permissions(pf: Preflight) -> CheckResult:
    name = "file permissions"
    paths = {f.path: pf.config.source_file(f) for f in pf.config.files}
    unreadable = [
        name for name, path in paths.items() if path.exists() and not os.access(path, os.R_OK)
    ]
    if unreadable:
        uid = f"uid {os.getuid()}"
        return CheckResult(name, Status.FAIL, f"not readable: {unreadable[0]}", uid)
    return CheckResult(name, Status.OK, f"readable by uid {os.getuid()}")


def check_target_writable(pf: Preflight) -> CheckResult:
    name = "target writable"
    if pf.target is None:
        return CheckResult(name, Status.OK, "no prewarmDir configured (runtime reads the source)")
    # Probe by writing (root passes os.access on a read-only mount), but create nothing that
    # lasts: diagnose must leave the node as it found it.
    where = _existing_parent(pf.target)
    probe = where / f".ember-write-test{PARTIAL_MARKER}{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return CheckResult(name, Status.FAIL, f"{where}: {err.strerror}", f"uid {os.getuid()}")
    note = "" if where == pf.target else f"will be created under {where}"
    return CheckResult(name, Status.OK, str(pf.target), note)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _target_usage(pf: Preflight) -> tuple[int, int]:
    """(bytes used in the target, of which bytes this prewarm would replace)."""
    assert pf.target is not None
    ours = {pf.target / f.path for f in pf.config.files}
    used = reclaim = 0
    if pf.target.is_dir():
        for p in pf.target.rglob("*"):
            if p.is_file() and not p.is_symlink():
                size = p.stat().st_size
                used += size
                if p in ours or PARTIAL_MARKER in p.name:
                    reclaim += size
    return used, reclaim


def check_shm_space(pf: Preflight) -> CheckResult:
    name = "shm free space"
    if pf.target is None:
        return CheckResult(name, Status.OK, "no prewarmDir configured")
    if pf.reusable():
        return CheckResult(name, Status.OK, "target already holds the verified model (reused)")
    need = pf.config.total_bytes() + pf.margin_bytes
    st = os.statvfs(_existing_parent(pf.target))
    used, reclaim = _target_usage(pf)
    free = st.f_bavail * st.f_frsize + reclaim
    source = "statvfs"
    if pf.shm_limit_bytes is not None and pf.shm_limit_bytes - used + reclaim < free:
        free, source = pf.shm_limit_bytes - used + reclaim, "sizeLimit"
    value = f"free {_mb(free)} ({source}), need {_mb(need)} incl. {_mb(pf.margin_bytes)} margin"
    if free >= need:
        return CheckResult(name, Status.OK, value)
    # The same remedy as a volume that fills up mid-copy, so the same reason (not the generic
    # PreflightFailed, which sends the user to `diagnose` for what the message already says).
    return CheckResult(name, Status.FAIL, value, reason=reasons.SHARED_MEMORY_FULL)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) means no limit


def _cgroup_memory_headroom(cgroup: Path) -> int | None:
    """Limit minus usage of this container's memory cgroup (v2, then v1), if limited."""
    for limit_file, usage_file in (
        (cgroup / "memory.max", cgroup / "memory.current"),
        (cgroup / "memory" / "memory.limit_in_bytes", cgroup / "memory" / "memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        # v1 reports "no limit" as a huge page-rounded number.
        if limit is not None and usage is not None and limit < (1 << 60):
            return max(limit - usage, 0)
    return None


def _mem_available(proc: Path) -> int | None:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def check_memory(pf: Preflight) -> CheckResult:
    """The shm copy is charged to the pod's memory, so the node and cgroup must hold it."""
    name = "free memory"
    node = _mem_available(pf.host.proc)
    if node is None:
        return CheckResult(name, Status.WARN, "MemAvailable unreadable", str(pf.host.proc))
    avail, source = node, "node"
    cg = _cgroup_memory_headroom(pf.host.cgroup)
    if cg is not None and cg < avail:
        avail, source = cg, "cgroup"
    total = pf.config.total_bytes()
    need = 0 if pf.reusable() or pf.target is None else total
    value = f"available {_mb(avail)} ({source}), model {_mb(total)}"
    if avail < need:
        return CheckResult(name, Status.FAIL, value, "the shm copy would not fit: OOM risk")
    if avail < need + total // 2:
        return CheckResult(name, Status.WARN, value, "little room left for the engine")
    return CheckResult(name, Status.OK, value)


def _cpu_flags(proc: Path) -> set[str]:
    flags: set[str] = set()
    try:
        text = (proc / "cpuinfo").read_text()
    except OSError:
        return flags
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(rest.split())
    return flags


def check_cpu_features(pf: Preflight) -> CheckResult:
    name = "cpu features"
    machine = pf.host.machine.lower()
    if machine in ("x86_64", "amd64"):
        need = "avx2"
    elif machine in ("aarch64", "arm64"):
        need = "asimd"
    else:
        return CheckResult(name, Status.WARN, f"unknown architecture {machine}")
    if need in _cpu_flags(pf.host.proc):
        return CheckResult(name, Status.OK, f"{machine}: {need}")
    # Only the CPU engine executes llama.cpp's vector kernels on this core.
    cpu_bound = pf.config.accelerator == "cpu" and pf.config.engine.kind == "llamacpp"
    status = Status.FAIL if cpu_bound else Status.WARN
    return CheckResult(name, status, f"{machine}: {need} missing", "llama.cpp build needs it")


def check_gpu(pf: Preflight) -> list[CheckResult]:
    try:
        gpus = pf.host.gpu.query()
    except ProbeError as err:
        return [CheckResult("nvidia driver", Status.FAIL, str(err))]
    if not gpus:
        return [CheckResult("nvidia driver", Status.FAIL, "nvidia-smi lists no GPU")]
    g = gpus[0]
    driver = CheckResult(
        "nvidia driver",
        Status.OK,
        f"{len(gpus)}× {g.name}, driver {g.driver_version}, CUDA {g.cuda_version}",
    )
    best = max(gpus, key=lambda x: x.memory_free_bytes)
    total = pf.config.total_bytes()
    free, of = _mb(best.memory_free_bytes), _mb(best.memory_total_bytes)
    value = f"GPU {best.index}: free {free} of {of}"
    status = Status.OK if best.memory_free_bytes >= total else Status.FAIL
    return [driver, CheckResult("gpu memory", status, value, f"model {_mb(total)}")]


def check_npu(pf: Preflight) -> list[CheckResult]:
    dev = pf.host.dev
    chips = sorted(p.name for p in dev.glob("davinci[0-9]*")) if dev.is_dir() else []
    missing = [n for n in NPU_DEVICE_NODES if not (dev / n).exists()]
    if not chips:
        missing.insert(0, "davinci<N>")
    nodes = (
        CheckResult("npu devices", Status.FAIL, f"missing {', '.join(missing)}", str(dev))
        if missing
        else CheckResult("npu devices", Status.OK, ", ".join(chips))
    )
    found = [f"{k}={pf.host.env[k]}" for k in NPU_ENV if pf.host.env.get(k)]
    env = (
        CheckResult("npu env", Status.OK, ", ".join(found))
        if found
        else CheckResult("npu env", Status.FAIL, f"neither {' nor '.join(NPU_ENV)} is set")
    )
    return [nodes, env]


CHECKS: tuple[Callable[[Preflight], CheckResult], ...] = (
    check_source_files,
    check_permissions,
    check_target_writable,
    check_shm_space,
    check_memory,
    check_cpu_features,
)


def run_checks(pf: Preflight) -> list[CheckResult]:
    results = [check(pf) for check in CHECKS]
    if pf.config.draft_file() is not None:
        results.insert(1, check_draft_model(pf))
    if pf.config.accelerator == "nvidia-gpu":
        results += check_gpu(pf)
    elif pf.config.accelerator == "npu":
        results += check_npu(pf)
    return results


def failures(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status is Status.FAIL]
