"""Does the thermal loop pay on a device that heats with its own work?

A site of three replicas (`python -m ember_runtime.server`: the real engine on the real Gemma 3
270M GGUF), each on its own thermal plant (tests/thermal/plant.py: temperature from a first-order
model driven by the CPU time the replica really consumed; the device's own throttle cuts its CPU
quota to the profile's fraction, its trip kills the replica until it has reset). Replica 0 sits
in a hot enclosure: its ambient rises for the middle of the run (a cabinet in the sun) and falls
again. One open-loop Poisson load (greedy, sampled and no-sampling-field requests in turn, the
same arrivals for every arm of a repeat), sized from the site's measured capacity, three arms:

  (a) static   — `thermal.policy: static` (batch stays at maxBatchSize), round robin over the
                 three (what llama-server behind a Service gives);
  (b) governor — the runtime's own governor, still round robin;
  (c) ladder   — the governor and the site gateway (heat routing; a Critical replica sheds new
                 work to its peers, the ladder's second step).

Phases (emulated time): cool, heating, sustained hot, cooling. Per arm and phase: client TTFT
p99 and ITL p99, goodput (tokens/s of requests within the SLO), failed requests; the hot
replica's ITL p99, seconds above its device's throttle temperature, trips, joules per output
token (the plant's energy over the tokens it served). `--repeats` runs, arms interleaved.

    flock /tmp/ember-cpu.lock .venv/bin/python bench/thermal_bench.py [--repeats 3]
        [--speed 10] [--profile ascend-310p] [--smoke]

Needs root (cgroup v1 cpu at /sys/fs/cgroup/cpu). Writes bench/results/thermal_bench.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ember_runtime.contract.thermal import ThermalPolicy

from bench.gateway_overhead import start
from bench.machine import steal_seconds
from tests.support.net import free_port
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.plant import PROFILES, CpuQuota, Plant, PlantedRuntime, Profile
from tests.thermal.runtime_proc import RuntimeProcess, start_runtime

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "gemma3-270m"
ARMS = ("static", "governor", "ladder")
CAPACITY = 16  # engine.maxBatchSize: the static arm's batch, the governor's ceiling
# Emulated seconds: the hot replica's enclosure warms at HEAT_AT and cools at COOL_AT.
PHASES = (("cool", 0, 150), ("heating", 150, 400), ("hot", 400, 700), ("cooling", 700, 900))
HEAT_AT, COOL_AT, END = 150.0, 700.0, 900.0
PROMPTS = (
    "Summarise in a few sentences why edge devices throttle when they get hot, and what an "
    "operator of a fleet of such devices should watch for.",
    "Write a short product description for a rugged fanless computer used in a wind farm.",
    "Explain to a new engineer how continuous batching works in an inference server.",
    "List five checks to run before deploying a model to a remote site with a slow link.",
    "Translate into plain English: the governor lowers the batch as the junction heats.",
    "Draft a polite reply to a customer whose kiosk answers slowly on hot afternoons.",
)
SAMPLING: tuple[dict[str, float], ...] = (  # what users send: greedy, sampled, and nothing at all
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.95},
    {},
)


def policy(arm: str, profile: Profile) -> ThermalPolicy:
    """The runtime's policy: its ladder acts below the device's own throttle point."""
    return ThermalPolicy(
        adaptive=arm != "static",
        min_batch_size=2,
        throttle_celsius=profile.throttle_celsius - 18,
        critical_celsius=profile.throttle_celsius - 8,
        celsius_per_step=1.0,
        hysteresis_celsius=3.0,
    )


def ambient(base: float, enclosure: float) -> Any:
    def at(emulated: float) -> float:
        return base + (enclosure if HEAT_AT <= emulated < COOL_AT else 0.0)

    return at


@dataclass
class Outcome:
    sent: float  # emulated seconds since the load began
    replica: int = -1
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


@dataclass
class Replica:
    """One replica of the site: its runtime (restarted on its port after a trip) and plant."""

    index: int
    runtime: PlantedRuntime
    plant: Plant

    @property
    def port(self) -> int:
        return self.runtime.port

    @property
    def url(self) -> str:
        return self.runtime.url

    def stop(self) -> None:
        self.plant.stop()
        self.runtime.stop()
        self.runtime.quota.close()


def start_site(arm: str, args: argparse.Namespace, work: Path) -> list[Replica]:
    profile = PROFILES[args.profile]
    thermal = policy(arm, profile)
    replicas = []
    for i in range(3):
        (work / f"r{i}").mkdir(parents=True)
        tree = FakeThermalTree(work / f"sys{i}")
        tree.zone(0, "cpu-thermal", args.ambient)
        runtime = PlantedRuntime(
            CpuQuota(f"r{i}", args.cpus), boot(work / f"r{i}", tree, thermal, args)
        )
        enclosure = args.enclosure if i == 0 else 0.0
        plant = Plant(
            profile,
            runtime.device(),
            tree,
            speed=args.speed,
            period=0.25,
            ambient=ambient(args.ambient, enclosure),
        )
        replicas.append(Replica(i, runtime, plant))
    return replicas


def boot(
    work: Path, tree: FakeThermalTree, thermal: ThermalPolicy, args: argparse.Namespace
) -> Callable[[int], RuntimeProcess]:
    """How a replica starts, on a given port: the real engine, 1 thread, the arm's policy."""
    return lambda port: start_runtime(
        work,
        tree.root,
        max_batch=CAPACITY,
        min_batch=thermal.min_batch_size,
        context=args.context,
        threads=1,
        thermal=thermal,
        interval=0.25,
        port=port,
        model=args.model,
    )


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """Server-sent event lines, split at LF only: httpx's `aiter_lines` also splits at U+2028
    and friends, which a sampled token may hold raw inside its JSON string."""
    buffer = ""
    async for text in resp.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.rstrip("\r")


async def send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome, ports: dict[str, int]
) -> None:
    began, last = time.perf_counter(), None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = str(resp.status_code)
                return
            served = resp.headers.get("x-ember-replica")  # the gateway's: host:port
            if served is not None:
                out.replica = ports.get(served.rsplit(":", 1)[-1], -1)
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not (json.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - began
                else:
                    out.gaps.append(now - last)
                last = now
                out.tokens += 1
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__


async def open_loop(
    arm: str, replicas: list[Replica], gateway: str, *, rate: float, seed: str, args: Any
) -> list[Outcome]:
    """Poisson arrivals at `rate` per real second until the emulated END."""
    arrivals = random.Random(seed)
    duration = END / args.speed
    ports = {str(r.port): r.index for r in replicas}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        tasks = []
        start_at, due, turn = time.perf_counter(), 0.0, 0
        while (due := due + arrivals.expovariate(rate)) < duration:
            await asyncio.sleep(max(0.0, start_at + due - time.perf_counter()))
            body = {
                "model": MODEL,
                "prompt": PROMPTS[turn % len(PROMPTS)],
                "max_tokens": args.max_tokens,
                "stream": True,
                **SAMPLING[turn % len(SAMPLING)],
            }
            out = Outcome(sent=due * args.speed)
            if arm == "ladder":
                url = gateway
            else:
                out.replica = turn % len(replicas)  # round robin
                url = replicas[out.replica].url
            outcomes.append(out)
            tasks.append(asyncio.create_task(send(client, url, body, out, ports)))
            turn += 1
        await asyncio.gather(*tasks)
    return outcomes


def watch(replicas: list[Replica], t0: float, speed: float, stop: threading.Event) -> list[Any]:
    """(emulated s, replica, batch limit, reason) every half second, from /admin/state."""
    seen: list[Any] = []
    while not stop.wait(0.5):
        now = (time.perf_counter() - t0) * speed
        for r in replicas:
            try:
                state = httpx.get(f"{r.url}/admin/state", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                seen.append((now, r.index, 0, "down"))
                continue
            seen.append((now, r.index, state.get("maxBatchSize"), state.get("thermalReason")))
    return seen


def capacity(replicas: list[Replica], seconds: float, args: argparse.Namespace) -> float:
    """Completed requests per second with CAPACITY back-to-back clients per replica."""

    async def loop() -> int:
        done = 0
        deadline = time.perf_counter() + seconds
        async with httpx.AsyncClient(timeout=args.timeout) as client:

            async def worker(i: int) -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    out = Outcome(sent=0.0)
                    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens}
                    await send(client, replicas[i % 3].url, {**body, "stream": True}, out, {})
                    done += not out.error

            await asyncio.gather(*(worker(i) for i in range(3 * CAPACITY)))
        return done

    return asyncio.run(loop()) / seconds


def run_arm(
    arm: str, args: argparse.Namespace, rate: float, seed: str, work: Path
) -> dict[str, Any]:
    replicas = start_site(arm, args, work)
    routes = work / "routes.json"
    routes.write_text(
        json.dumps({"models": [{"name": MODEL, "replicas": [r.url for r in replicas]}]})
    )
    port = free_port()
    argv = [sys.executable, "-m", "ember_runtime.gateway", "--static", str(routes)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    gateway = start(argv, f"http://127.0.0.1:{port}/readyz", work / "gateway.log")
    stop = threading.Event()
    seen: list[Any] = []
    try:
        t0 = time.perf_counter()
        for r in replicas:
            r.plant.start()
        watcher = threading.Thread(
            target=lambda: seen.extend(watch(replicas, t0, args.speed, stop)), daemon=True
        )
        watcher.start()
        outcomes = asyncio.run(
            open_loop(arm, replicas, f"http://127.0.0.1:{port}", rate=rate, seed=seed, args=args)
        )
        stop.set()
        watcher.join()
    finally:
        stop.set()
        gateway.terminate()
        gateway.wait(30)
        for r in replicas:
            r.stop()
    return summarise(arm, replicas, outcomes, seen, args)


def p99(values: list[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def in_phase(t: float, phase: tuple[str, int, int]) -> bool:
    return phase[1] <= t < phase[2]


def phase_figures(
    outcomes: list[Outcome], phase: tuple[str, int, int], args: argparse.Namespace
) -> dict[str, Any]:
    mine = [o for o in outcomes if in_phase(o.sent, phase)]
    ok = [o for o in mine if not o.error and o.tokens]
    hot = [o for o in ok if o.replica == 0]
    good = [
        o
        for o in ok
        if o.ttft <= args.slo_ttft and (not o.gaps or statistics.mean(o.gaps) <= args.slo_tpot)
    ]
    seconds = (phase[2] - phase[1]) / args.speed  # real seconds of the phase
    return {
        "requests": len(mine),
        "failed": len(mine) - len(ok),
        "ttft_p99_ms": _ms(p99([o.ttft for o in ok])),
        "itl_p99_ms": _ms(p99([g for o in ok for g in o.gaps])),
        "goodput_tok_s": sum(o.tokens for o in good) / seconds,
        "hot_requests": len(hot),
        "hot_itl_p99_ms": _ms(p99([g for o in hot for g in o.gaps])),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def summarise(
    arm: str,
    replicas: list[Replica],
    outcomes: list[Outcome],
    seen: list[Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    plant = replicas[0].plant
    profile = plant.profile
    log = [entry for entry in plant.log if entry[0] < END]  # the load's span, not the drain
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(log)]
    above = sum(dt for dt, e in zip(gaps, log, strict=False) if e[1] >= profile.throttle_celsius)
    hot_tokens = sum(o.tokens for o in outcomes if o.replica == 0 and not o.error)
    all_tokens = sum(o.tokens for o in outcomes if not o.error)
    joules = [r.plant.state.joules for r in replicas]
    return {
        "arm": arm,
        "phases": {ph[0]: phase_figures(outcomes, ph, args) for ph in PHASES},
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if o.error),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "hot": {
            "seconds_above_throttle": round(above, 1),
            "share_above_throttle": round(above / END, 4),
            "seconds_device_throttled": round(
                sum(dt for dt, e in zip(gaps, log, strict=False) if e[3]), 1
            ),
            "trips": plant.state.trips,
            "peak_celsius": round(max(e[1] for e in log), 1),
            "joules_per_token": round(joules[0] / hot_tokens, 3) if hot_tokens else None,
            "tokens": hot_tokens,
        },
        "site_joules_per_token": round(sum(joules) / all_tokens, 3) if all_tokens else None,
        "series": {
            "plant": [
                (round(t, 1), round(c, 2), round(w, 1), th, down)
                for (t, c, w, th, down) in plant.log[:: max(1, len(plant.log) // 600)]
            ],
            "batch": [(round(t, 1), b, reason) for (t, i, b, reason) in seen if i == 0],
            "tokens": [
                (round(o.sent, 1), o.replica, _ms(p99(o.gaps)))
                for o in outcomes
                if o.gaps and not o.error
            ],
        },
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    real = [v for v in values if v is not None]
    if not real:
        return None
    return {"median": statistics.median(real), "min": min(real), "max": max(real)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: every figure's median and range over the repeats."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        phases = {
            ph: {k: spread([r["phases"][ph][k] for r in mine]) for k in mine[0]["phases"][ph]}
            for ph, _, _ in PHASES
        }
        hot = {k: spread([r["hot"][k] for r in mine]) for k in mine[0]["hot"]}
        total = {k: spread([r[k] for r in mine]) for k in ("failed", "site_joules_per_token")}
        out[arm] = {"phases": phases, "hot": hot, **total}
    return out


def goals(agg: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ladder, static, governor = agg["ladder"], agg["static"], agg["governor"]

    def worst(arm: str, key: str) -> float:
        return float(max(r["hot"][key] for r in runs if r["arm"] == arm))

    def goodput(a: dict[str, Any]) -> float:
        return float(sum(a["phases"][ph]["goodput_tok_s"]["median"] for ph, _, _ in PHASES))

    ratios = []
    for r in (r for r in runs if r["arm"] == "ladder"):
        cool, hot = r["phases"]["cool"]["hot_itl_p99_ms"], r["phases"]["hot"]["hot_itl_p99_ms"]
        ratios.append(hot / cool if hot and cool else None)
    ratio = spread(ratios)
    static_hurt = worst("static", "trips") > 0 or worst("static", "seconds_device_throttled") > 0
    return [
        {
            "goal": "(c) no trip and <= 1% of the time above throttle, "
            "where (a) trips or throttles",
            "met": worst("ladder", "trips") == 0
            and worst("ladder", "share_above_throttle") <= 0.01
            and static_hurt,
            "figure": f"(c) trips {worst('ladder', 'trips'):.0f}, above throttle "
            f"{100 * worst('ladder', 'share_above_throttle'):.1f}% (worst run); (a) trips "
            f"{worst('static', 'trips'):.0f}, device throttled "
            f"{worst('static', 'seconds_device_throttled'):.0f} s",
        },
        {
            "goal": "(c) hot replica's ITL p99 while hot <= 1.2x its cool p99",
            "met": ratio is not None and ratio["max"] <= 1.2,
            "figure": "no hot-phase requests on the hot replica"
            if ratio is None
            else f"{ratio['median']:.2f}x (range {ratio['min']:.2f}-{ratio['max']:.2f})",
        },
        {
            "goal": "(c) site goodput >= 0.95x (a)'s and no client-visible error",
            "met": goodput(ladder) >= 0.95 * goodput(static) and ladder["failed"]["max"] == 0,
            "figure": f"{goodput(ladder) / goodput(static):.2f}x, failed requests "
            f"{ladder['failed']['max']:.0f} (worst run)",
        },
        {
            "goal": "(c) ahead of (b): less time throttled by the device, no more trips, "
            "goodput within 2%",
            "met": worst("ladder", "seconds_device_throttled")
            < max(1.0, worst("governor", "seconds_device_throttled"))
            and worst("ladder", "trips") <= worst("governor", "trips")
            and goodput(ladder) >= 0.98 * goodput(governor),
            "figure": f"device throttled (c) {worst('ladder', 'seconds_device_throttled'):.0f} s "
            f"vs (b) {worst('governor', 'seconds_device_throttled'):.0f} s (worst runs); trips "
            f"(c) {worst('ladder', 'trips'):.0f} vs (b) {worst('governor', 'trips'):.0f}; goodput "
            f"(c)/(b) {goodput(ladder) / goodput(governor):.2f}x",
        },
    ]


def _cell(value: dict[str, float] | None, fmt: str = ".0f") -> str:
    if value is None:
        return "–"
    if value["min"] == value["max"]:
        return f"{value['median']:{fmt}}"
    return f"{value['median']:{fmt}} ({value['min']:{fmt}}–{value['max']:{fmt}})"


def render(out: dict[str, Any]) -> str:
    agg, meta = out["arms"], out["meta"]
    lines = [
        f"# Thermal loop on a plant that heats with its own work ({meta['profile']})",
        "",
        f"{meta['repeats']} repeats per arm, arms interleaved; {meta['rate']:.2f} requests/s "
        f"(open loop, {meta['load_fraction']:.0%} of the cool site's measured "
        f"{meta['capacity']:.2f}/s); {meta['max_tokens']} tokens per request, greedy/sampled/"
        f"no sampling fields in turn; time x{meta['speed']:.0f} ({END:.0f} s emulated per run, "
        f"{END / meta['speed']:.0f} s real); site air {meta['ambient']:.0f} °C, replica 0's "
        f"enclosure +{meta['enclosure']:.0f} °C "
        f"from {HEAT_AT:.0f} to {COOL_AT:.0f} s. Device: throttle {meta['device_throttle']} °C "
        f"(CPU quota to {meta['throttled_fraction']:.0%}), trip {meta['device_trip']} °C; "
        f"runtime policy throttle {meta['policy_throttle']} °C, critical (shed) "
        f"{meta['policy_critical']} °C. Each replica 1 thread, {meta['cpus']} CPU at full clock. "
        f"SLO: TTFT <= {meta['slo_ttft']} s, TPOT <= {meta['slo_tpot'] * 1000:.0f} ms. "
        f"Load average before {meta['loadavg_before']}, after {meta['loadavg_after']}; steal "
        f"{meta['steal_seconds']:.1f} s.",
        "",
        "Cells: median (min–max) over the repeats.",
        "",
        "| arm | phase | TTFT p99 ms | ITL p99 ms | goodput tok/s | failed "
        "| hot replica ITL p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        for ph, _, _ in PHASES:
            f = agg[arm]["phases"][ph]
            lines.append(
                f"| {arm} | {ph} | {_cell(f['ttft_p99_ms'])} | {_cell(f['itl_p99_ms'])} | "
                f"{_cell(f['goodput_tok_s'], '.1f')} | {_cell(f['failed'])} | "
                f"{_cell(f['hot_itl_p99_ms'])} |"
            )
    lines += [
        "",
        "| arm | hot replica: s above device throttle | device throttled s | trips | peak °C "
        "| J/token (hot) | J/token (site) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        h = agg[arm]["hot"]
        lines.append(
            f"| {arm} | {_cell(h['seconds_above_throttle'])} | "
            f"{_cell(h['seconds_device_throttled'])} | {_cell(h['trips'])} | "
            f"{_cell(h['peak_celsius'], '.1f')} | {_cell(h['joules_per_token'], '.2f')} | "
            f"{_cell(agg[arm]['site_joules_per_token'], '.2f')} |"
        )
    lines += ["", "## Goals", ""]
    for g in out["goals"]:
        lines.append(f"- {'MET' if g['met'] else 'MISSED'}: {g['goal']} — {g['figure']}")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for arm, colour in zip(ARMS, ("tab:red", "tab:orange", "tab:green"), strict=True):
        run = next(r for r in runs if r["arm"] == arm)  # the first repeat of each
        plant = run["series"]["plant"]
        axes[0].plot([p[0] for p in plant], [p[1] for p in plant], color=colour, label=arm)
        batch = run["series"]["batch"]
        axes[1].step([b[0] for b in batch], [b[1] or 0 for b in batch], color=colour, where="post")
        hot = [t for t in run["series"]["tokens"] if t[1] == 0 and t[2] is not None]
        axes[2].scatter([t[0] for t in hot], [t[2] for t in hot], s=4, color=colour)
    meta_throttle = runs[0]["meta"]["device_throttle"]
    axes[0].axhline(meta_throttle, color="grey", linestyle="--", linewidth=0.8)
    axes[0].set_ylabel("hot replica °C")
    axes[0].legend()
    axes[1].set_ylabel("batch limit (0: down)")
    axes[2].set_ylabel("request ITL p99 ms")
    axes[2].set_xlabel("emulated seconds")
    for ax in axes:
        for ph in PHASES[1:]:
            ax.axvline(ph[1], color="lightgrey", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--profile", default="ascend-310p", choices=sorted(PROFILES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speed", type=float, default=10.0, help="emulated s per real s")
    ap.add_argument("--ambient", type=float, default=25.0, help="the site's air, °C")
    ap.add_argument("--enclosure", type=float, default=30.0, help="°C added to replica 0's air")
    ap.add_argument("--cpus", type=float, default=0.5, help="cores per replica at full clock")
    ap.add_argument("--load-fraction", type=float, default=0.2)
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: measured)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--slo-ttft", type=float, default=10.0)
    ap.add_argument("--slo-tpot", type=float, default=0.5)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--smoke", action="store_true", help="one repeat, written as *_smoke")
    ap.add_argument("--replot", type=Path, default=None, help="redraw from a results JSON")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.replot is not None:  # the tables and figure again, from the data
        out = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(render(out))
        plot(out["runs"], args.replot.with_suffix(".png"))
        return
    repeats = 1 if args.smoke else args.repeats
    work = Path(tempfile.mkdtemp(prefix="thermal-bench-"))
    before, steal = os.getloadavg(), steal_seconds()
    rate = args.rate
    measured = None
    if rate is None:
        site = start_site("static", args, work / "capacity")
        try:
            measured = capacity(site, 20.0, args)
        finally:
            for r in site:
                r.stop()
        rate = args.load_fraction * measured
    print(f"capacity {measured} req/s, offering {rate:.2f}/s", flush=True)
    runs: list[dict[str, Any]] = []
    profile = PROFILES[args.profile]
    for rep in range(repeats):
        order = ARMS[rep % 3 :] + ARMS[: rep % 3]
        for arm in order:
            run = run_arm(arm, args, rate, f"thermal/{rep}", work / f"{rep}-{arm}")
            run["repeat"] = rep
            runs.append(run)
            print(arm, rep, json.dumps(run["hot"]), flush=True)
    the_policy = policy("ladder", profile)
    meta = {
        "profile": args.profile,
        "repeats": repeats,
        "rate": rate,
        "capacity": measured or 0.0,
        "load_fraction": args.load_fraction if measured else 0.0,
        "max_tokens": args.max_tokens,
        "speed": args.speed,
        "ambient": args.ambient,
        "enclosure": args.enclosure,
        "device_throttle": profile.throttle_celsius,
        "device_trip": profile.trip_celsius,
        "throttled_fraction": profile.throttled_fraction,
        "policy_throttle": the_policy.throttle_celsius,
        "policy_critical": the_policy.critical_celsius,
        "cpus": args.cpus,
        "slo_ttft": args.slo_ttft,
        "slo_tpot": args.slo_tpot,
        "loadavg_before": [round(x, 2) for x in before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "steal_seconds": steal_seconds() - steal,
    }
    for run in runs:
        run["meta"] = meta
    agg = aggregate(runs)
    out = {"meta": meta, "arms": agg, "goals": goals(agg, runs), "runs": runs}
    stem = "thermal_bench_smoke" if args.smoke else "thermal_bench"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(render(out))
    plot(runs, args.out / f"{stem}.png")
    print(render(out), flush=True)


if __name__ == "__main__":
    main()
