"""Prewarm benchmark: copy throughput, and first start / restart on throttled edge storage.

    sudo .venv/bin/python bench/prewarm_bench.py [--reps 3] [--big-mib 2048] [--slow-mbps 50]

Needs root: it drops the page cache before each cold run, makes a loop-device ext4 filesystem
and throttles reads from it with the cgroup v1 blkio controller (the reading process is moved
into a child cgroup), like an eMMC/SD card on an edge node.

1. Throughput, page cache dropped before each run: `cp`, `sha256sum` and the prewarm CLI
   (hash while copying, into /dev/shm), for the Gemma 3 270M GGUF and a generated file.
2. Slow storage: (a) first start = prewarm + runtime ready vs runtime reading the slow disk
   directly; (b) restart = runtime ready from the shm copy vs re-reading the slow disk.
   "Runtime ready" is a fresh process: import llama_cpp, `Llama(model_path, use_mmap=True,
   n_ctx=512)`, then one eval of a short prompt — with mmap the load alone touches few pages,
   the first eval touches all weights, so ready = load + first eval is the honest figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime")]

BLKIO = Path("/sys/fs/cgroup/blkio")
SHM = Path("/dev/shm")

LOAD_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
llm = Llama(model_path=sys.argv[1], use_mmap=True, n_ctx=512, verbose=False)
t2 = time.perf_counter()
llm.eval(llm.tokenize(b"The capital of France is"))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "eval_s": t3 - t2}))
"""


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(argv: list[str], preexec: Callable[[], None] | None = None) -> tuple[float, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "runtime"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    t0 = time.perf_counter()
    done = subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=preexec, env=env, check=False
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, done.stdout


@dataclass
class Model:
    path: Path
    sha256: str
    size: int


def write_config(work: Path, model: Model, target: Path) -> Path:
    config = {
        "modelName": "bench",
        "modelDir": str(model.path.parent),
        "prewarmDir": str(target),
        "files": [{"path": model.path.name, "sha256": model.sha256, "sizeBytes": model.size}],
        "terminationLog": str(work / "termination-log"),
    }
    path = work / f"config-{model.path.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def prewarm_argv(config: Path) -> list[str]:
    return [sys.executable, "-m", "ember_runtime.prewarm", "prewarm", "--config", str(config)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- 1. throughput -------------------------------------------------------------------------


def throughput(work: Path, model: Model, reps: int) -> dict[str, float]:
    target = SHM / "ember-bench-target"
    config = write_config(work, model, target)
    runs: dict[str, list[float]] = {"cp": [], "sha256sum": [], "prewarm": [], "copy_phase": []}
    for _ in range(reps):
        for tool in ("cp", "sha256sum", "prewarm"):
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            drop_caches()
            if tool == "cp":
                wall, _ = timed(["cp", str(model.path), str(target / model.path.name)])
            elif tool == "sha256sum":
                wall, out = timed(["sha256sum", str(model.path)])
                assert out.split()[0] == model.sha256
            else:
                wall, out = timed(prewarm_argv(config))
                runs["copy_phase"].append(copy_phase_mbps(out))
            runs[tool].append(model.size / wall / 1e6)
    shutil.rmtree(target, ignore_errors=True)
    return {tool: median(v) for tool, v in runs.items()}


def copy_phase_mbps(stdout: str) -> float:
    """The rate on the CLI's last progress line: the copy alone, without process start-up."""
    last = [line for line in stdout.splitlines() if "MB/s" in line][-1]
    return float(last.split(" MB/s")[0].rsplit(" ", 1)[1])


def print_throughput(rows: dict[str, dict[str, float]]) -> None:
    print("\n## 1. Throughput, cold page cache (median MB/s)")
    print(
        "prewarm CLI = whole process (start-up, preflight, copy+hash, manifest); "
        "copy phase = its progress figure"
    )
    print(
        f"| {'file':<24} | {'cp':>6} | {'sha256sum':>9} | {'prewarm CLI':>11} | "
        f"{'copy phase':>10} | CLI/cp | phase/cp |"
    )
    print(f"|{'-' * 26}|{'-' * 8}|{'-' * 11}|{'-' * 13}|{'-' * 12}|--------|----------|")
    for name, r in rows.items():
        print(
            f"| {name:<24} | {r['cp']:>6.0f} | {r['sha256sum']:>9.0f} | {r['prewarm']:>11.0f} "
            f"| {r['copy_phase']:>10.0f} | {r['prewarm'] / r['cp']:>5.2f}× "
            f"| {r['copy_phase'] / r['cp']:>7.2f}× |"
        )


# --- 2. slow storage ------------------------------------------------------------------------


@dataclass
class SlowDisk:
    mount: Path
    device: str
    cgroup: Path

    def enter(self) -> None:
        """preexec_fn: move this (child) process into the throttled cgroup before exec."""
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def slow_disk(work: Path, size_mib: int, bps: int) -> Iterator[SlowDisk]:
    image, mount = work / "slow.img", work / "slow-mnt"
    with image.open("wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    device = subprocess.run(
        ["losetup", "--find", "--show", "--direct-io=on", str(image)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    cgroup = BLKIO / f"ember-bench-{os.getpid()}"
    try:
        mount.mkdir(exist_ok=True)
        subprocess.run(["mount", device, str(mount)], check=True)
        cgroup.mkdir()
        st = os.stat(device)
        rule = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {bps}"
        (cgroup / "blkio.throttle.read_bps_device").write_text(rule)
        yield SlowDisk(mount, device, cgroup)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
        with contextlib.suppress(OSError):
            cgroup.rmdir()
        image.unlink(missing_ok=True)


def runtime_ready(model_path: Path, disk: SlowDisk) -> dict[str, float]:
    wall, out = timed([sys.executable, "-c", LOAD_SNIPPET, str(model_path)], disk.enter)
    return {**json.loads(out), "wall_s": wall}


def measured_read_mbps(path: Path, disk: SlowDisk) -> float:
    drop_caches()
    wall, _ = timed(["dd", f"if={path}", "of=/dev/null", "bs=4M"], disk.enter)
    return path.stat().st_size / wall / 1e6


def slow_storage(work: Path, model: Model, reps: int, mbps: int) -> None:
    with slow_disk(work, size_mib=model.size // (1 << 20) + 128, bps=mbps * 1_000_000) as disk:
        slow = Model(disk.mount / model.path.name, model.sha256, model.size)
        shutil.copyfile(model.path, slow.path)
        os.sync()
        read = measured_read_mbps(slow.path, disk)
        print(
            f"\n## 2. Slow storage: {disk.device} ext4, blkio read_bps_device = {mbps} MB/s; "
            f"measured cold `dd` read {read:.1f} MB/s"
        )
        if read > mbps * 1.5:
            print("   !! the throttle did not hold: the slow-disk figures below are not slow")
        target = SHM / "ember-bench-slow"
        config = write_config(work, slow, target)
        rows: dict[str, list[float]] = {
            k: []
            for k in (
                "bare_ready",
                "prewarm",
                "ready_from_shm",
                "restart_shm",
                "restart_disk_cold",
                "restart_disk_warm",
                "load_shm",
                "load_disk_cold",
            )
        }
        for _ in range(reps):
            drop_caches()
            bare = runtime_ready(slow.path, disk)
            rows["bare_ready"].append(bare["wall_s"])
            rows["load_disk_cold"].append(bare["load_s"] + bare["eval_s"])
            rows["restart_disk_warm"].append(runtime_ready(slow.path, disk)["wall_s"])
            shutil.rmtree(target, ignore_errors=True)
            drop_caches()
            rows["prewarm"].append(timed(prewarm_argv(config), disk.enter)[0])
            first = runtime_ready(target / slow.path.name, disk)
            rows["ready_from_shm"].append(first["wall_s"])
            drop_caches()  # a restart after memory pressure: tmpfs survives, page cache not
            again = runtime_ready(target / slow.path.name, disk)
            rows["restart_shm"].append(again["wall_s"])
            rows["load_shm"].append(again["load_s"] + again["eval_s"])
            drop_caches()
            rows["restart_disk_cold"].append(runtime_ready(slow.path, disk)["wall_s"])
        shutil.rmtree(target, ignore_errors=True)
        print_slow({k: median(v) for k, v in rows.items()})


def print_slow(m: dict[str, float]) -> None:
    first = m["prewarm"] + m["ready_from_shm"]
    print("\n### (a) first start (median s, fresh processes, page cache dropped)")
    print("| path                                   | ready s |")
    print("|----------------------------------------|---------|")
    print(f"| runtime reads slow disk directly       | {m['bare_ready']:7.2f} |")
    print(f"| prewarm (slow disk → shm, verified)    | {m['prewarm']:7.2f} |")
    print(f"|   + runtime ready from shm             | {m['ready_from_shm']:7.2f} |")
    print(f"| prewarm + runtime, total               | {first:7.2f} |")
    print(f"ratio (prewarm+runtime) / bare = {first / m['bare_ready']:.3f}  (goal ≤ 1.05)")
    print("\n### (b) runtime restart (median s)")
    print("| restart from                                | ready s | load+eval s |")
    print("|---------------------------------------------|---------|-------------|")
    print(
        f"| shm copy (page cache dropped: no effect)    | {m['restart_shm']:7.2f} | "
        f"{m['load_shm']:11.2f} |"
    )
    print(
        f"| slow disk, page cache dropped (re-read)     | {m['restart_disk_cold']:7.2f} | "
        f"{m['load_disk_cold']:11.2f} |"
    )
    print(
        f"| slow disk, page cache still warm            | {m['restart_disk_warm']:7.2f} | "
        f"{'':>11} |"
    )
    print(
        f"speed-up shm vs re-read slow disk = "
        f"{m['restart_disk_cold'] / m['restart_shm']:.1f}×  (goal ≥ 5×); "
        f"shm restart / warm in-memory restart = "
        f"{m['restart_shm'] / m['restart_disk_warm']:.2f}  (goal ≤ 1.2)"
    )


def generated(work: Path, mib: int) -> Model:
    path = work / f"generated-{mib}MiB.bin"
    if not path.exists() or path.stat().st_size != mib << 20:
        with path.open("wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
    from ember_runtime.models import sha256_file

    return Model(path, sha256_file(path), path.stat().st_size)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes-mib", default="2048", help="generated file sizes, comma-separated")
    p.add_argument(
        "--no-gemma",
        action="store_true",
        help="generated files only (a host without the model package)",
    )
    p.add_argument("--slow-mbps", type=int, default=50)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ember-bench")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-slow", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: drop_caches, losetup, mount and blkio cgroups")
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        f"# prewarm bench: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, reps {args.reps}"
    )
    gemma = None
    if not args.no_gemma:
        from ember_runtime.models import default_model_path, sha256_file

        path = default_model_path()
        gemma = Model(path, sha256_file(path), path.stat().st_size)
    if not args.skip_throughput:
        rows = {}
        if gemma is not None:
            rows[f"gemma-3-270m ({gemma.size / 1e6:.0f} MB)"] = throughput(
                args.work, gemma, args.reps
            )
        for mib in (int(x) for x in args.sizes_mib.split(",")):
            big = generated(args.work, mib)
            rows[f"generated ({big.size / 1e6:.0f} MB)"] = throughput(args.work, big, args.reps)
            big.path.unlink()
        print_throughput(rows)
    if not args.skip_slow and gemma is not None:
        slow_storage(args.work, gemma, args.reps, args.slow_mbps)


if __name__ == "__main__":
    main()
