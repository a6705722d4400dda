"""Does thermal control pay? Static max batch 16 vs the runtime's own governor on a hot device.

The runtime (real engine, real model) reads its temperature from a fake thermal tree; the bench
ramps it 70 → 92 → 70 °C (a triangle over `--duration` s) and, like a throttling NPU, caps the
runtime's CPU with a cgroup v1 quota that falls linearly from 100% of `--cpus` at 70 °C to 45%
at 92 °C (the field report's figure). 8 streaming clients keep the server busy. Two runs:

  (a) static   — `thermal.adaptive: false`: max batch stays 16;
  (b) adaptive — the runtime's own governor (`ember_runtime.thermal.governor`) applies the policy
                 from its config at every sensor sample (`--interval`, 0.25 s), no network.

Reported per temperature band (cool < 78, warm 78–86, hot ≥ 86 °C): inter-token latency p50/p99
and output tok/s, plus reaction times (the sensor file's crossing → the batch limit in force,
read from `/admin/state` every 50 ms), as a table, JSON and a PNG (temperature, CPU quota, max
batch, p99 ITL over time, both runs) under bench/results/thermal_bench.{md,json,png}.

    sudo .venv/bin/python bench/thermal_bench.py [--duration 120] [--clients 8] [--step 2]
                                                  [--interval 0.25]

Needs root (cgroup v1 at /sys/fs/cgroup/cpu) and the model (`ember_runtime.models`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ember_runtime.contract.thermal import ThermalPolicy

from tests.thermal.conftest import FakeThermalTree
from tests.thermal.runtime_proc import RuntimeProcess, start_runtime

RESULTS = Path(__file__).resolve().parent / "results"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
CAPACITY = 16  # engine.maxBatchSize: the engine's sequences and the policy's ceiling
LOW, HIGH, MIN_QUOTA = 70.0, 92.0, 0.45
BANDS = (("cool <78", -1e9, 78.0), ("warm 78-86", 78.0, 86.0), ("hot >=86", 86.0, 1e9))
PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a "
    "bottle. Describe the setting, the weather, the sounds and the smells, introduce every "
    "character with care, and do not stop early. The story begins like this: It was"
)


def temperature_at(t: float, duration: float) -> float:
    half = duration / 2
    frac = t / half if t <= half else max(0.0, (duration - t) / half)
    return LOW + (HIGH - LOW) * min(1.0, frac)


def quota_fraction(temp: float) -> float:
    return 1.0 - (1.0 - MIN_QUOTA) * (temp - LOW) / (HIGH - LOW)


class CpuCap:
    """A cgroup v1 cpu child holding the runtime process; the quota is written as it heats."""

    def __init__(self, pid: int, cpus: float) -> None:
        self.path = CGROUP_CPU / f"ember-thermal-bench-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.cpus = cpus
        self.set(1.0)
        (self.path / "cgroup.procs").write_text(str(pid))  # all its threads, and future ones

    def set(self, fraction: float) -> None:
        (self.path / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * self.cpus * fraction)))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # it exited meanwhile
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        self.path.rmdir()


@dataclass
class Series:
    t: list[float] = field(default_factory=list)
    temp: list[float] = field(default_factory=list)
    quota: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    tokens: list[tuple[float, float]] = field(default_factory=list)  # (time, gap since previous)
    changes: list[tuple[float, int]] = field(default_factory=list)


async def client_loop(
    url: str, stop: asyncio.Event, start: float, out: Series, max_tokens: int
) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            last: float | None = None
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await asyncio.sleep(0.2)
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if not (json.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                        continue
                    now = time.monotonic() - start
                    if last is not None:
                        out.tokens.append((now, now - last))
                    last = now


async def driver(
    proc: RuntimeProcess,
    tree: FakeThermalTree,
    cap: CpuCap,
    *,
    duration: float,
    start: float,
    out: Series,
    stop: asyncio.Event,
) -> None:
    async with httpx.AsyncClient(base_url=proc.url, timeout=5) as http:
        while (t := time.monotonic() - start) < duration:
            temp = temperature_at(t, duration)
            tree.set(0, temp)
            cap.set(quota_fraction(temp))
            state = (await http.get("/admin/state")).json()
            out.t.append(t)
            out.temp.append(temp)
            out.quota.append(quota_fraction(temp))
            out.batch.append(int(state["maxBatchSize"]))
            await asyncio.sleep(0.5)
    stop.set()


async def watcher(url: str, start: float, out: Series, stop: asyncio.Event) -> None:
    """Every batch-limit change the governor makes, timed to within 50 ms."""
    previous: int | None = None
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while not stop.is_set():
            batch = int((await http.get("/admin/state")).json()["maxBatchSize"])
            if previous is not None and batch != previous:
                out.changes.append((time.monotonic() - start, batch))
            previous = batch
            await asyncio.sleep(0.05)


async def one_run(adaptive: bool, args: argparse.Namespace, limits: ThermalPolicy) -> Series:
    work = Path(tempfile.mkdtemp(prefix="thermal-bench-"))
    tree = FakeThermalTree(work / "sys")
    tree.zone(0, "npu-thermal", LOW)
    proc = start_runtime(
        work,
        tree.root,
        max_batch=CAPACITY,
        min_batch=limits.min_batch_size,
        context=args.context,
        interval=args.interval,
        threads=args.threads,
        thermal=limits.model_copy(update={"adaptive": adaptive}),
    )
    cap = CpuCap(proc.proc.pid, args.cpus)
    out, stop = Series(), asyncio.Event()
    try:
        start = time.monotonic()
        tasks = [
            asyncio.create_task(client_loop(proc.url, stop, start, out, args.max_tokens))
            for _ in range(args.clients)
        ]
        tasks.append(asyncio.create_task(watcher(proc.url, start, out, stop)))
        await driver(proc, tree, cap, duration=args.duration, start=start, out=out, stop=stop)
        _, pending = await asyncio.wait(tasks, timeout=60)
        for task in pending:
            task.cancel()
    finally:
        proc.stop()
        cap.close()
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def band_stats(run: Series, duration: float) -> dict[str, tuple[float, float, float]]:
    out = {}
    for name, low, high in BANDS:
        gaps = [g for t, g in run.tokens if low <= temperature_at(t, duration) < high]
        seconds = sum(0.5 for t in run.t if low <= temperature_at(t, duration) < high)
        out[name] = (pct(gaps, 0.5) * 1000, pct(gaps, 0.99) * 1000, len(gaps) / max(seconds, 1e-9))
    return out


def _edge(run: Series, duration: float, heating: bool, celsius: float) -> float | None:
    """First sample time on the heating half at/above `celsius` (cooling half: below it)."""
    for t in run.t:
        temp = temperature_at(t, duration)
        if (t <= duration / 2) == heating and (temp >= celsius if heating else temp < celsius):
            return t
    return None


def reaction_delays(
    run: Series, limits: ThermalPolicy, duration: float
) -> list[tuple[str, float, int, float | None]]:
    """Delay from the temperature crossing that allows a batch to the runtime running it.

    Heating: batch b is due once T >= throttle + (16 − b)·step. Cooling: b is allowed once a
    reading `hysteresis` hotter would allow it (T < throttle + (17 − b)·step − hyst), and 16
    once T < throttle − hysteresis.
    """
    out: list[tuple[str, float, int, float | None]] = []
    thr, step, hyst = limits.throttle_celsius, limits.celsius_per_step, limits.hysteresis_celsius
    previous = CAPACITY
    for when, batch in run.changes:
        heating = batch < previous
        previous = batch
        if heating:
            edge = _edge(run, duration, True, thr + (16 - batch) * step)
        elif batch == CAPACITY:
            edge = _edge(run, duration, False, thr - hyst)
        else:
            edge = _edge(run, duration, False, thr + (17 - batch) * step - hyst)
        phase = "heating" if heating else "cooling"
        out.append((phase, when, batch, None if edge is None else when - edge))
    return out


def reactions(run: Series, limits: ThermalPolicy, duration: float) -> list[str]:
    lines = []
    for phase, when, batch, delay in reaction_delays(run, limits, duration):
        text = f"{delay:4.2f}s after its crossing" if delay is not None else "n/a"
        lines.append(f"{phase}: → {batch:2d} at {when:6.1f}s, {text}")
    return lines


def window_p99(run: Series, width: float = 5.0) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for t in run.t[::4]:
        gaps = [g for tt, g in run.tokens if t - width <= tt < t]
        if gaps:
            xs.append(t)
            ys.append(pct(gaps, 0.99) * 1000)
    return xs, ys


def plot(static: Series, adaptive: Series, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    axes[0].plot(static.t, static.temp, color="tab:red")
    axes[0].set_ylabel("temperature °C")
    axes[1].plot(static.t, [q * 100 for q in static.quota], color="tab:gray")
    axes[1].set_ylabel("CPU quota %")
    for run, label in ((static, "static 16"), (adaptive, "adaptive")):
        axes[2].step(run.t, run.batch, where="post", label=label)
        axes[3].plot(*window_p99(run), label=label)
    axes[2].set_ylabel("max batch")
    axes[3].set_ylabel("p99 inter-token ms (5 s)")
    axes[3].set_xlabel("seconds")
    for ax in axes[2:]:
        ax.legend()
    fig.suptitle("Ember thermal governor (in the runtime): static vs adaptive max batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(static: Series, adaptive: Series, duration: float) -> str:
    s, a = band_stats(static, duration), band_stats(adaptive, duration)
    rows = [
        "| band | static ITL p50 ms | static p99 ms | static tok/s | adaptive p50 ms | "
        "adaptive p99 ms | adaptive tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, _, _ in BANDS:
        rows.append(
            f"| {name} | {s[name][0]:.1f} | {s[name][1]:.1f} | {s[name][2]:.1f} | "
            f"{a[name][0]:.1f} | {a[name][1]:.1f} | {a[name][2]:.1f} |"
        )
    cool, hot = a[BANDS[0][0]][1], a[BANDS[2][0]][1]
    rows.append("")
    rows.append(
        f"adaptive hot/cool p99 = {hot / cool:.2f}x (goal <= 1.15x); "
        f"static hot/cool p99 = {s[BANDS[2][0]][1] / s[BANDS[0][0]][1]:.2f}x; "
        f"adaptive vs static hot p99 = {hot / s[BANDS[2][0]][1]:.2f}x"
    )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="ramp 70→92→70 length, s")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", type=float, default=1.0, help="nominal CPU quota (cores) at 70 °C")
    p.add_argument("--step", type=float, default=2.0, help="thermal.celsiusPerStep")
    p.add_argument("--interval", type=float, default=0.25, help="sensor sampling period, s")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not CGROUP_CPU.joinpath("cpu.cfs_quota_us").exists() or os.geteuid() != 0:
        sys.exit("needs root and cgroup v1 (/sys/fs/cgroup/cpu) to emulate the throttling device")
    limits = ThermalPolicy(min_batch_size=4, throttle_celsius=78, celsius_per_step=args.step)
    load_before = os.getloadavg()
    static = asyncio.run(one_run(False, args, limits))
    adaptive = asyncio.run(one_run(True, args, limits))
    load_after = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "thermal_bench"
    plot(static, adaptive, stem.with_suffix(".png"))
    report = "\n".join(
        [
            f"clients {args.clients}, max_tokens {args.max_tokens}, ramp {args.duration:.0f}s, "
            f"step {args.step:g} °C, CPU {args.cpus:g} core(s) → 45% at 92 °C, "
            f"threads {args.threads}; load average (1/5/15 min) before "
            f"{'/'.join(f'{x:.2f}' for x in load_before)}, after "
            f"{'/'.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs",
            table(static, adaptive, args.duration),
            "",
            "adaptive batch changes:",
            *reactions(adaptive, limits, args.duration),
            f"tokens: static {len(static.tokens)}, adaptive {len(adaptive.tokens)}; "
            f"mean ITL static {statistics.fmean(g for _, g in static.tokens) * 1000:.1f} ms, "
            f"adaptive {statistics.fmean(g for _, g in adaptive.tokens) * 1000:.1f} ms",
        ]
    )
    stem.with_suffix(".md").write_text(report + "\n")
    delays = reaction_delays(adaptive, limits, args.duration)
    figures = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "loadAverage": {"before": load_before, "after": load_after},
        "static": band_stats(static, args.duration),
        "adaptive": band_stats(adaptive, args.duration),
        "reactions": [
            {"phase": p, "at": w, "batch": b, "delaySeconds": d} for p, w, b, d in delays
        ],
        "maxHeatingReactionSeconds": max(
            (d for p, _, _, d in delays if p == "heating" and d is not None), default=None
        ),
    }
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    print(report)
    print(f"plot: {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
