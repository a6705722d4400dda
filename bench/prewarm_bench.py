"""Prewarm benchmark: copy throughput, and first start / restart on throttled edge storage.

    sudo .venv/bin/python bench/prewarm_bench.py [--reps 3] [--big llama-3b] [--slow-mbps 50]

Needs root: it drops the page cache before each cold run, makes a loop-device ext4 filesystem
and throttles reads from it with the cgroup v1 blkio controller (the reading process is moved
into a child cgroup), like an eMMC/SD card on an edge node.

1. Throughput, page cache dropped before each run: `cp`, `sha256sum` and the prewarm CLI
   (hash while copying, into /dev/shm), for the packaged Gemma 3 270M GGUF and a ≥ 2 GB
   random-weight GGUF in a real architecture's shapes (default: Llama 3.2 3B, Q8_0, 3.4 GB;
   bench/gpu_models.py writes it once into --work).
2. Slow storage, for both: (a) first start = prewarm + Ember's server ready from the shm copy
   vs the server reading the slow disk directly (goal ≤ 1.02×); (b) restart = the server ready
   from the shm copy vs re-reading the slow disk (goal ≥ 20× faster). "Ready" is Ember's own
   server, `python -m ember_runtime.server`, answering /readyz 200: it has imported, loaded the
   model and run its warm-up decode (which touches every weight).
Results: bench/results/prewarm_bench.{md,json,png}.
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
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime")]

BLKIO = Path("/sys/fs/cgroup/blkio")
SHM = Path("/dev/shm")


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


def runtime_ready(model_path: Path, disk: SlowDisk, work: Path) -> float:
    """Seconds from spawning Ember's own server (`python -m ember_runtime.server`, the process a
    pod runs) on `model_path` until /readyz answers 200: imports, load, warm-up decode."""
    from tests.thermal.runtime_proc import start_runtime

    run = work / "runtime"
    shutil.rmtree(run, ignore_errors=True)
    (run / "sys").mkdir(parents=True)  # an empty sysfs: no thermal zones, no readings
    began = time.perf_counter()
    server = start_runtime(
        run, run / "sys", model=model_path, preexec=disk.enter, ready_timeout=900, poll=0.02
    )
    wall = time.perf_counter() - began
    if server.stop() != 0:
        raise RuntimeError(f"runtime did not exit cleanly:\n{server.log.read_text()[-2000:]}")
    return wall


def measured_read_mbps(path: Path, disk: SlowDisk) -> float:
    drop_caches()
    wall, _ = timed(["dd", f"if={path}", "of=/dev/null", "bs=4M"], disk.enter)
    return path.stat().st_size / wall / 1e6


SLOW_ROWS = ("bare_ready", "prewarm", "ready_from_shm", "restart_shm", "restart_disk_cold",
             "restart_disk_warm")  # fmt: skip


def slow_storage(work: Path, model: Model, reps: int, mbps: int) -> dict[str, float]:
    # ext4 takes its journal and inode tables out of the image: 5 % and 256 MiB to spare
    size_mib = int(model.size * 1.05) // (1 << 20) + 256
    with slow_disk(work, size_mib=size_mib, bps=mbps * 1_000_000) as disk:
        slow = Model(disk.mount / model.path.name, model.sha256, model.size)
        shutil.copyfile(model.path, slow.path)
        os.sync()
        read = measured_read_mbps(slow.path, disk)
        if read > mbps * 1.5:
            raise RuntimeError(f"the throttle did not hold: cold dd read {read:.0f} MB/s")
        target = SHM / "ember-bench-slow"
        config = write_config(work, slow, target)
        rows: dict[str, list[float]] = {k: [] for k in SLOW_ROWS}
        for _ in range(reps):
            drop_caches()
            rows["bare_ready"].append(runtime_ready(slow.path, disk, work))
            rows["restart_disk_warm"].append(runtime_ready(slow.path, disk, work))
            shutil.rmtree(target, ignore_errors=True)
            drop_caches()
            rows["prewarm"].append(timed(prewarm_argv(config), disk.enter)[0])
            rows["ready_from_shm"].append(runtime_ready(target / slow.path.name, disk, work))
            drop_caches()  # a restart after memory pressure: tmpfs survives, page cache not
            rows["restart_shm"].append(runtime_ready(target / slow.path.name, disk, work))
            drop_caches()
            rows["restart_disk_cold"].append(runtime_ready(slow.path, disk, work))
        shutil.rmtree(target, ignore_errors=True)
    return {
        "size_bytes": model.size,
        "dd_read_mbps": read,
        **{k: median(v) for k, v in rows.items()},
    }


FIRST_GOAL, RESTART_GOAL, BIG_BYTES = 1.02, 20.0, 2_000_000_000


def slow_ratios(m: dict[str, float]) -> tuple[float, float]:
    """(first start / direct read, restart speed-up) for one model's medians."""
    first = (m["prewarm"] + m["ready_from_shm"]) / m["bare_ready"]
    return first, m["restart_disk_cold"] / m["restart_shm"]


def slow_markdown(models: dict[str, dict[str, float]], mbps: int) -> list[str]:
    out = [
        f"## 2. Slow storage: loop-device ext4 throttled to {mbps} MB/s (blkio), page cache "
        "dropped",
        "",
        "Median seconds until Ember's server (`python -m ember_runtime.server`) answers "
        "/readyz 200 — imports, model load and its warm-up decode — in fresh processes.",
        "",
        "| model | cold dd MB/s | direct from slow disk | prewarm | + server from shm | "
        "first start ratio | restart: slow disk re-read | restart: shm | speed-up | "
        "restart, page cache warm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in models.items():
        first, speedup = slow_ratios(m)
        out.append(
            f"| {name} | {m['dd_read_mbps']:.1f} | {m['bare_ready']:.2f} | {m['prewarm']:.2f} | "
            f"{m['ready_from_shm']:.2f} | {first:.3f}× | {m['restart_disk_cold']:.2f} | "
            f"{m['restart_shm']:.2f} | {speedup:.1f}× | {m['restart_disk_warm']:.2f} |"
        )
    out += ["", f"Goals, for the model of ≥ {BIG_BYTES / 1e9:.0f} GB (smaller ones for context):"]
    for name, m in models.items():
        first, speedup = slow_ratios(m)
        if m["size_bytes"] < BIG_BYTES:
            out.append(f"- {name}: first start {first:.3f}×, restart {speedup:.1f}× (not judged)")
            continue
        out.append(
            f"- {name}: first start {first:.3f}× direct (goal ≤ {FIRST_GOAL}×: "
            f"{'met' if first <= FIRST_GOAL else 'missed'}); restart {speedup:.1f}× faster "
            f"from shm (goal ≥ {RESTART_GOAL:.0f}×: "
            f"{'met' if speedup >= RESTART_GOAL else 'missed'}, {speedup / RESTART_GOAL:.2f}× "
            "the goal)"
        )
    return out


def throughput_markdown(rows: dict[str, dict[str, float]]) -> list[str]:
    out = [
        "## 1. Throughput, cold page cache (median MB/s)",
        "",
        "prewarm CLI = the whole process (start-up, preflight, copy+hash into /dev/shm, "
        "manifest); copy phase = its own progress figure.",
        "",
        "| file | cp | sha256sum | prewarm CLI | copy phase | CLI/cp | phase/cp |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['cp']:.0f} | {r['sha256sum']:.0f} | {r['prewarm']:.0f} | "
            f"{r['copy_phase']:.0f} | {r['prewarm'] / r['cp']:.2f}× | "
            f"{r['copy_phase'] / r['cp']:.2f}× |"
        )
    return [*out, ""]


def plot(models: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items(), strict=True):
        labels = ["first:\ndirect", "first:\nprewarm+shm", "restart:\nslow disk",
                  "restart:\nshm"]  # fmt: skip
        ax.bar(labels[:1], [m["bare_ready"]], color="tab:gray")
        ax.bar(labels[1:2], [m["prewarm"]], color="tab:blue", label="prewarm")
        ax.bar(labels[1:2], [m["ready_from_shm"]], bottom=[m["prewarm"]], color="tab:orange",
               label="server from shm")  # fmt: skip
        ax.bar(labels[2:3], [m["restart_disk_cold"]], color="tab:gray")
        ax.bar(labels[3:], [m["restart_shm"]], color="tab:orange")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("seconds to /readyz 200")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def big_model(work: Path, shape: str) -> Model:
    """A random-weight GGUF in a real architecture's shapes (bench/gpu_models.py), cached."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_models import write_model
    from tests.support.model import sha256_file

    path = write_model(shape, work)
    return Model(path, sha256_file(path), path.stat().st_size)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--big", default="llama-3b", help="bench/gpu_models.py shape (≥ 2 GB)")
    p.add_argument("--slow-mbps", type=int, default=50)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ember-bench")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: drop_caches, losetup, mount and blkio cgroups")
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    from tests.support.model import default_model_path, sha256_file

    path = default_model_path()
    models = {
        f"gemma-3-270m Q4_K_M ({path.stat().st_size / 1e6:.0f} MB)": Model(
            path, sha256_file(path), path.stat().st_size
        )
    }
    big = big_model(args.work, args.big)
    models[f"{args.big} random weights ({big.size / 1e6:.0f} MB)"] = big
    through = {name: throughput(args.work, m, args.reps) for name, m in models.items()}
    slow = {
        name: slow_storage(args.work, m, args.reps, args.slow_mbps) for name, m in models.items()
    }
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "throughput_mbps": through,
        "slow_storage_s": slow,
        "goals": {"first_start_max": FIRST_GOAL, "restart_speedup_min": RESTART_GOAL},
    }
    md = markdown(result)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prewarm_bench.md").write_text(md)
    (args.out / "prewarm_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(slow, args.out / "prewarm_bench.png")


def markdown(result: dict[str, Any]) -> str:
    """The results file, from the JSON alone (so it can be rendered again from a past run)."""
    a = result["args"]

    def loads(key: str) -> str:
        return " / ".join(f"{x:.2f}" for x in result[key])

    return "\n".join(
        [
            "# Prewarm benchmark",
            "",
            f"`sudo .venv/bin/python bench/prewarm_bench.py --reps {a['reps']} --big {a['big']} "
            f"--slow-mbps {a['slow_mbps']}`; load average before {loads('loadavg_before')}, "
            f"after {loads('loadavg_after')}; {result['cpus']} CPUs, {a['reps']} reps.",
            "",
            *throughput_markdown(result["throughput_mbps"]),
            *slow_markdown(result["slow_storage_s"], int(a["slow_mbps"])),
            "",
        ]
    )


if __name__ == "__main__":
    main()
