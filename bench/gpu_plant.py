"""The GPU's own thermal plant, measured (issue 45): steady power, temperature and joules per
token of the card at 1, 4, 16 and 64 concurrent clients, the calibration of a GPU profile.

Runs on the GPU machine with `gpu_bench.py`'s setup (`BENCH=plant bash bench/gpu_run.sh`; the
build, wheels and `LD_PRELOAD` are gpu_run.sh's). The card's settings are read, never changed
(no power limit, clock lock or persistence mode is set): what is measured is the card as lent.

* the model and server are gpu_bench.py's: the 8B-shaped random-weight GGUF (`bench/gpu_models.py`)
  served by Ember (`gpu_bench.ember_server`: every layer offloaded, `engine.maxBatchSize` 64,
  512 tokens of context per slot; its thermal governor off, so the batch is what the clients
  ask for), started once for the whole call;
* NVML every 0.5 s on a thread (`gpu_bench.NvmlLog`, extended): power (W), temperature (°C),
  SM clock, utilisation, the total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ,
  where the card has one) and the clock-event (throttle) reasons;
* idle: `--idle-seconds` with the server up and no request (the power an idle replica draws);
* then, in order, windows of 1, 4, 16 and 64 closed-loop streaming clients, each for
  `--window-seconds`: every client sends requests back to back until the window's end, the
  requests in flight then finish and count. Requests as users send them: gpu_bench's ~62-token
  distinct prompts, 64 tokens out, their sampling mixed in turn: greedy (temperature 0), sampled
  (temperature 0.8, top_p 0.95) and no sampling field (`runtime_bench.request_body`). The clients
  are dealt over up to 8 processes, as gpu_bench.py deals them;
* per window: steady power and temperature (median, min and max of the samples in its last
  half), output tok/s, joules per output token over the whole window (the energy counter's
  delta from the window's start to its last request's end, over the tokens; the power
  readings' integral over the same span as a cross-check) and over the last half alone
  (each request's tokens spread evenly from its first token to its end);
* then `--cool-seconds` idle again: the temperature's fall gives the time constant τ.

From these, a first-order profile (`tests/thermal/plant.py`'s `Profile`): idle W, the most W
seen, R = (T_steady − T_idle) / (P_steady − P_idle) at each level (the 64-client one, the
largest step, is the estimate), C = τ / R, the card's slowdown and shutdown temperatures (NVML
thresholds), and the ambient that makes T = ambient + R·P hold at idle. R is an incremental
figure of this card in this chassis: the fans (the BMC's curve for an SXM module, the card's
own for a PCIe one) speed up as it warms, so R falls with load and depends on the inlet air.

Writes `OUT/gpu_plant.json` (every NVML sample too) and `OUT/gpu_plant.md`; the JSON after every
window, so a call cut short keeps what it measured.

    python bench/gpu_plant.py --models DIR --out DIR [--deadline S] [--window-seconds 75]
        [--idle-seconds 15] [--cool-seconds 30] [--levels 1,4,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_bench import CLIENT_PROCS, MAX_TOKENS, NvmlLog, NvmlSample, ember_server
from bench.gpu_models import write_model
from bench.runtime_bench import CTX_PER_SEQ, SAMPLING, one_request, pct, request_body

MODEL = "llama-8b"  # gpu_bench.py's default (`--only`)
LEVELS = (1, 4, 16, 64)
SLOTS = 64  # gpu_bench.py's: the most clients
THERMAL = {"adaptive": False}  # the runtime's thermal policy: no governor
MODES = tuple(SAMPLING)  # greedy, sampled, client-defaults: taken in turn
INTERVAL = 0.5
START_DELAY = 1.0  # s from a window's forks to its common start (connections open)
# Seconds a window costs beyond its duration (forks, connections, the requests in flight at its
# end), and what the call spends before the first window (GGUF written, server up), for the
# deadline's arithmetic.
WINDOW_OVERHEAD = 5.0
SETUP_SECONDS = 60.0
# Clock-event ("throttle") reason bits of NVML (nvml.h, nvmlClocksEventReason*).
REASONS = {
    0x1: "idle",
    0x2: "applications clocks",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal",
    0x40: "HW thermal",
    0x80: "HW power brake",
    0x100: "display clock",
}


# --- NVML --------------------------------------------------------------------------------------


@dataclass
class PlantSample(NvmlSample):
    energy_mj: float | None = None  # the card's total-energy counter since the driver loaded
    reasons: int | None = None  # clock-event reasons (bits of REASONS)


class PlantLog(NvmlLog):
    """gpu_bench's sampler with the energy counter and the clock-event reasons; read-only."""

    def read(self) -> PlantSample:
        nv, h = self._nv, self._h
        energy: float | None = None
        reasons: int | None = None
        with contextlib.suppress(nv.NVMLError):
            energy = float(nv.nvmlDeviceGetTotalEnergyConsumption(h))
        with contextlib.suppress(nv.NVMLError, AttributeError):
            reasons = int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        return PlantSample(**asdict(super().read()), energy_mj=energy, reasons=reasons)

    def plant(self) -> list[PlantSample]:
        return [s for s in self.samples if isinstance(s, PlantSample)]

    def card(self) -> dict[str, Any]:
        """What the card is set to (read, not set): power limits, temperature thresholds."""
        nv, h = self._nv, self._h
        info: dict[str, Any] = {"name": self.name}
        reads: dict[str, Callable[[], Any]] = {
            "power_limit_w": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "power_limit_default_w": lambda: (
                nv.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0
            ),
            "slowdown_celsius": lambda: nv.nvmlDeviceGetTemperatureThreshold(
                h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
            "shutdown_celsius": lambda: nv.nvmlDeviceGetTemperatureThreshold(
                h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
            ),
            "gpu_max_celsius": lambda: nv.nvmlDeviceGetTemperatureThreshold(
                h, nv.NVML_TEMPERATURE_THRESHOLD_GPU_MAX
            ),
            "sm_max_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "driver": lambda: str(nv.nvmlSystemGetDriverVersion()),
            "fan_percent": lambda: nv.nvmlDeviceGetFanSpeed(h),
        }
        for key, read in reads.items():
            try:
                info[key] = read()
            except nv.NVMLError as exc:
                info[key] = None
                info.setdefault("unsupported", []).append(f"{key}: {exc}")
        return info


def interp(samples: list[PlantSample], t: float, key: str) -> float | None:
    """`key` at time `t`, linear between the samples around it (the nearest at either end)."""
    points = [(s.t, getattr(s, key)) for s in samples if getattr(s, key) is not None]
    if not points:
        return None
    if t <= points[0][0]:
        return float(points[0][1])
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return float(v0 + (v1 - v0) * (t - t0) / max(t1 - t0, 1e-9))
    return float(points[-1][1])


def energy_j(samples: list[PlantSample], a: float, b: float) -> float | None:
    """The energy counter's delta over [a, b], joules; None where the card has no counter."""
    ea, eb = interp(samples, a, "energy_mj"), interp(samples, b, "energy_mj")
    return None if ea is None or eb is None else (eb - ea) / 1000.0


def power_integral_j(samples: list[PlantSample], a: float, b: float) -> float:
    """The power readings' integral over [a, b] (trapezoids), joules."""
    pa, pb = interp(samples, a, "watts"), interp(samples, b, "watts")
    points = [(a, pa or 0.0), *((s.t, s.watts) for s in samples if a < s.t < b), (b, pb or 0.0)]
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(points))


def spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def reasons_seen(samples: list[PlantSample]) -> list[str]:
    bits = 0
    for s in samples:
        bits |= s.reasons or 0
    return [name for bit, name in REASONS.items() if bits & bit]


def steady(samples: list[PlantSample], a: float, b: float) -> dict[str, Any]:
    inside = [s for s in samples if a <= s.t <= b]
    return {
        "samples": len(inside),
        "watts": spread([s.watts for s in inside]),
        "celsius": spread([s.celsius for s in inside]),
        "sm_mhz": spread([float(s.sm_mhz) for s in inside]),
        "util": spread([float(s.util) for s in inside]),
        "clock_reasons": reasons_seen(inside),
    }


# --- load: closed-loop clients, sampling mixed ---------------------------------------------------


@dataclass
class Req:
    mode: str
    sent: float  # wall clock
    first: float  # wall clock of its first token
    end: float
    tokens: int


async def _mixed_clients(
    base: str, clients: int, indices: list[int], serial: int, window: tuple[float, float]
) -> tuple[list[Req], list[str]]:
    """Clients `indices` (of `clients`), each sending requests back to back from `window[0]`
    until `window[1]` (wall clock), the sampling mode taken in turn; the requests in flight at
    the end finish and count."""
    start_at, stop_at = window
    done: list[Req] = []
    failures: list[str] = []
    limits = httpx.Limits(max_connections=len(indices) + 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        # A throw-away request per client: connections open before the clock starts.
        await asyncio.gather(*(client.get("/v1/models") for _ in indices))
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def worker(index: int) -> None:
            turn = 0
            while time.time() < stop_at:
                n = index + turn * clients
                mode = MODES[n % len(MODES)]
                path, body = request_body(f"distinct/{mode}", n, MAX_TOKENS, serial)
                sent = time.time()
                try:
                    stat = await one_request(client, path, body)
                    done.append(Req(mode, sent, sent + stat.ttft, time.time(), stat.tokens))
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])
                    await asyncio.sleep(0.1)
                turn += 1

        await asyncio.gather(*(worker(i) for i in indices))
    return done, failures


def _clients_process(
    job: tuple[str, int, list[int], int, tuple[float, float]],
) -> tuple[list[Req], list[str]]:
    base, clients, indices, serial, window = job
    return asyncio.run(_mixed_clients(base, clients, indices, serial, window))


def run_window(
    base: str, clients: int, seconds: float, serial: int
) -> tuple[list[Req], list[str], float]:
    """`clients` clients for `seconds` over forked processes; (requests, failures, start wall)."""
    import multiprocessing

    procs = max(1, min(CLIENT_PROCS, clients))
    start_at = time.time() + START_DELAY
    window = (start_at, start_at + seconds)
    jobs = [(base, clients, list(range(clients))[p::procs], serial, window) for p in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_clients_process, jobs)
    return [r for part in parts for r in part[0]], [f for part in parts for f in part[1]], start_at


def tokens_in(reqs: list[Req], a: float, b: float) -> float:
    """Output tokens made in [a, b] (wall clock): each request's spread evenly from its first
    token to its end."""
    total = 0.0
    for r in reqs:
        span = r.end - r.first
        if span <= 0:
            total += r.tokens if a <= r.end <= b else 0
            continue
        overlap = max(0.0, min(b, r.end) - max(a, r.first))
        total += r.tokens * overlap / span
    return total


# --- the call ----------------------------------------------------------------------------------


@dataclass
class Clock:
    """Wall clock (the client processes') to the sampler's time (monotonic - its t0)."""

    offset: float

    @classmethod
    def of(cls, log: NvmlLog) -> Clock:
        return cls(time.time() - time.monotonic() + log.t0)

    def t(self, wall: float) -> float:
        return wall - self.offset


def measure_idle(log: PlantLog, seconds: float) -> dict[str, Any]:
    a = time.monotonic() - log.t0
    time.sleep(seconds)
    b = time.monotonic() - log.t0
    samples = log.plant()
    joules = energy_j(samples, a, b)
    return {
        "from": round(a, 2),
        "to": round(b, 2),
        **steady(samples, a, b),
        "energy_watts": None if joules is None else joules / (b - a),
    }


def measure_level(
    log: PlantLog, base: str, clients: int, seconds: float, serial: int
) -> dict[str, Any]:
    clock = Clock.of(log)
    reqs, failures, start_wall = run_window(base, clients, seconds, serial)
    end_wall = max((r.end for r in reqs), default=start_wall + seconds)
    time.sleep(2 * INTERVAL)  # the sampler's readings past the last request's end
    samples = log.plant()
    a, stop, b = clock.t(start_wall), clock.t(start_wall + seconds), clock.t(end_wall)
    half = a + seconds / 2
    tokens = sum(r.tokens for r in reqs)
    joules = energy_j(samples, a, b)
    integral = power_integral_j(samples, a, b)
    steady_tokens = tokens_in(reqs, start_wall + seconds / 2, start_wall + seconds)
    steady_joules = energy_j(samples, half, stop)
    if steady_joules is None:
        steady_joules = power_integral_j(samples, half, stop)
    ttfts = [r.first - r.sent for r in reqs]
    return {
        "clients": clients,
        "seconds": seconds,
        "from": round(a, 2),
        "to": round(b, 2),
        "requests": len(reqs),
        "by_mode": {m: sum(1 for r in reqs if r.mode == m) for m in MODES},
        "errors": len(failures),
        "first_error": failures[0] if failures else "",
        "tokens": tokens,
        "tok_s": tokens / max(b - a, 1e-6),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "energy_j": joules,
        "power_integral_j": integral,
        "j_per_token": None if joules is None or not tokens else joules / tokens,
        "j_per_token_integral": integral / tokens if tokens else None,
        "steady": steady(samples, half, stop),
        "steady_tok_s": steady_tokens / (seconds / 2),
        "steady_j_per_token": steady_joules / steady_tokens if steady_tokens else None,
        "peak_watts": max((s.watts for s in samples if a <= s.t <= b), default=None),
        "peak_celsius": max((s.celsius for s in samples if a <= s.t <= b), default=None),
    }


def cool_tau(samples: list[PlantSample], a: float, b: float) -> dict[str, Any] | None:
    """Time from the load's end for the temperature to fall 63% of the way to where it settles:
    τ of a first-order plant. None when the fall is under 3 °C (1 °C readings) or does not
    reach 63% within the cool-down."""
    inside = [s for s in samples if a <= s.t <= b]
    if len(inside) < 4:
        return None
    hot = inside[0].celsius
    floor_ = min(s.celsius for s in inside[-max(2, len(inside) // 6) :])
    fall = hot - floor_
    if fall < 3:
        return {"fall_celsius": fall, "tau_s": None, "note": "fall under 3 °C"}
    target = hot - 0.632 * fall
    reached = next((s.t for s in inside if s.celsius <= target), None)
    return {
        "hot_celsius": hot,
        "settled_celsius": floor_,
        "fall_celsius": fall,
        "tau_s": None if reached is None else round(reached - a, 1),
        "note": "settled = the last sixth of the cool-down: an underestimate of the fall if it "
        "had not settled, so τ is a lower bound",
    }


def fit_profile(report: dict[str, Any]) -> dict[str, Any]:
    idle = report["idle"]
    p_idle, t_idle = idle["watts"]["median"], idle["celsius"]["median"]
    per_level = []
    for lv in report["levels"]:
        dp = lv["steady"]["watts"]["median"] - p_idle
        dt = lv["steady"]["celsius"]["median"] - t_idle
        per_level.append(
            {"clients": lv["clients"], "dP_w": dp, "dT_c": dt, "R": dt / dp if dp > 5 else None}
        )
    usable = [r for r in per_level if r["R"] is not None]
    best = max(usable, key=lambda r: r["dP_w"], default=None)
    resistance = best["R"] if best else None
    seen = [s["watts"] for s in report["samples"]]
    tau = (report.get("cool") or {}).get("tau_s")
    card = report["card"]
    return {
        "idle_watts": p_idle,
        "idle_celsius": t_idle,
        "max_watts_seen": max(seen, default=None),
        "power_limit_w": card.get("power_limit_w"),
        "resistance": resistance,
        "resistance_from_clients": best["clients"] if best else None,
        "per_level": per_level,
        "tau_s": tau,
        "capacitance": tau / resistance if tau and resistance else None,
        "ambient_effective": t_idle - resistance * p_idle if resistance else None,
        "throttle_celsius": card.get("slowdown_celsius"),
        "trip_celsius": card.get("shutdown_celsius"),
    }


def _f(value: float | None, fmt: str = ".0f") -> str:
    return "–" if value is None else format(value, fmt)


def _range(d: dict[str, float], fmt: str = ".0f") -> str:
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}–{d['max']:{fmt}})"


def markdown(report: dict[str, Any]) -> str:
    card, idle, prof = report["card"], report["idle"], report.get("profile") or {}
    out = [
        f"# GPU plant, measured: {card['name']} (issue 45)",
        "",
        f"{report['started']}; driver {card.get('driver')}; the card as lent, nothing set "
        f"(power limit {_f(card.get('power_limit_w'))} W, default "
        f"{_f(card.get('power_limit_default_w'))} W; slowdown "
        f"{_f(card.get('slowdown_celsius'))} °C, shutdown {_f(card.get('shutdown_celsius'))} °C; "
        f"fan {'not reported' if card.get('fan_percent') is None else card['fan_percent']}). "
        f"Model: `{report['model']}` (bench/gpu_models.py, random weights in Llama 3.1 8B's "
        f"shapes, Q4_0) served by Ember as bench/gpu_bench.py serves it (every layer offloaded, "
        f"maxBatchSize {SLOTS}, {CTX_PER_SEQ} tokens of context per slot). Closed-loop "
        f"streaming clients, ~62-token distinct prompts, {MAX_TOKENS} tokens out, sampling "
        "mixed in turn (temperature 0; temperature 0.8 top_p 0.95; no sampling field). NVML "
        f"every {INTERVAL} s. Steady = the median (min–max) of the samples in a window's last "
        "half. J/token = the energy counter's delta from the window's start to its last "
        "request's end over the output tokens (∫P: the power readings' integral instead); "
        "steady J/token = the last half's energy over the tokens made in it.",
        "",
        "| clients | window s | requests | tok/s | steady W | steady °C | SM MHz | J/token | "
        "J/token ∫P | steady J/token | clock reasons | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        f"| idle | {idle['to'] - idle['from']:.0f} | – | – | {_range(idle['watts'])} | "
        f"{_range(idle['celsius'])} | {idle['sm_mhz']['median']:.0f} | – | – | – | "
        f"{', '.join(idle['clock_reasons']) or '–'} | – |",
    ]
    for lv in report["levels"]:
        st = lv["steady"]
        out.append(
            f"| {lv['clients']} | {lv['seconds']:.0f} | {lv['requests']} | {lv['tok_s']:.0f} | "
            f"{_range(st['watts'])} | {_range(st['celsius'])} | {st['sm_mhz']['median']:.0f} | "
            f"{_f(lv['j_per_token'], '.3f')} | {_f(lv['j_per_token_integral'], '.3f')} | "
            f"{_f(lv['steady_j_per_token'], '.3f')} | {', '.join(st['clock_reasons']) or '–'} | "
            f"{lv['errors']} |"
        )
    if prof:
        rs = ", ".join(
            f"{r['clients']}: {_f(r['R'], '.3f')}" for r in prof["per_level"] if r["R"] is not None
        )
        out += [
            "",
            f"First-order profile (`tests/thermal/plant.py` `Profile`): idle "
            f"{prof['idle_watts']:.0f} W at {prof['idle_celsius']:.0f} °C, max seen "
            f"{_f(prof['max_watts_seen'])} W (limit {_f(prof['power_limit_w'])} W), R = "
            f"(T_steady − T_idle)/(P_steady − P_idle) = {_f(prof['resistance'], '.3f')} °C/W "
            f"(from {prof['resistance_from_clients']} clients; per level {rs or 'none'}), "
            f"τ {_f(prof['tau_s'], '.0f')} s from the cool-down → C = τ/R "
            f"{_f(prof['capacitance'], '.0f')} J/°C, effective ambient (T_idle − R·P_idle) "
            f"{_f(prof['ambient_effective'], '.1f')} °C, throttle {_f(prof['throttle_celsius'])} "
            f"°C, trip {_f(prof['trip_celsius'])} °C.",
            "",
            "Caveat: R is incremental and holds for this card in this chassis only: the fans "
            "(the chassis BMC's curve for an SXM module, the card's own for a PCIe one) speed up "
            "as it warms, so R falls with load and moves with the inlet air; τ from one "
            f"{report['cool_seconds']:.0f} s cool-down is a lower bound when the fall had not "
            "settled. Steady is the last half of a window of minutes, not a thermal equilibrium "
            "of the heatsink.",
        ]
    if report.get("skipped"):
        out += ["", f"Not run (deadline): {'; '.join(report['skipped'])}."]
    return "\n".join(out) + "\n"


def save(report: dict[str, Any], log: PlantLog, out: Path) -> None:
    report["samples"] = [asdict(s) for s in log.plant()]
    if report.get("idle") and report["levels"]:
        report["profile"] = fit_profile(report)
    (out / "gpu_plant.json").write_text(json.dumps(report, indent=1))
    if report.get("idle"):
        (out / "gpu_plant.md").write_text(markdown(report))


def window_seconds(args: argparse.Namespace, stop_at: float, levels: list[int]) -> float:
    """`--window-seconds`, or less where the levels left would not fit the deadline."""
    left = stop_at - time.monotonic() - float(args.cool_seconds) - 5
    fit = left / max(1, len(levels)) - WINDOW_OVERHEAD
    return max(20.0, min(float(args.window_seconds), fit))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start")
    ap.add_argument("--window-seconds", type=float, default=75.0)
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    ap.add_argument("--cool-seconds", type=float, default=30.0)
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    args = ap.parse_args()
    stop_at = time.monotonic() + args.deadline
    levels = [int(x) for x in args.levels.split(",") if x]
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    log = PlantLog(interval=INTERVAL)
    log.start()
    report: dict[str, Any] = {
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "argv": sys.argv[1:],
        "card": log.card(),
        "model": MODEL,
        "slots": SLOTS,
        "max_tokens": MAX_TOKENS,
        "modes": list(MODES),
        "interval_s": INTERVAL,
        "cool_seconds": args.cool_seconds,
        "before_load": asdict(log.read()),
        "levels": [],
        "skipped": [],
    }
    print(json.dumps(report["card"]), flush=True)
    model = write_model(MODEL, args.models)
    # The governor off (`adaptive: false`: always maxBatchSize): the plant is measured at the
    # batch the clients ask for, whatever the card's temperature. (ember_server's own default,
    # `{"maxBatchSize": ..., "minBatchSize": 1}`, is refused by the runtime's ThermalPolicy,
    # which has had no maxBatchSize since the contract package took it to engine.maxBatchSize.)
    server = ember_server(model, SLOTS, work, THERMAL)
    began = time.monotonic()
    server.start(work)
    report["load_seconds"] = round(time.monotonic() - began, 1)
    try:
        report["idle"] = measure_idle(log, args.idle_seconds)
        print("idle", json.dumps({k: report["idle"][k] for k in ("watts", "celsius")}), flush=True)
        for index, clients in enumerate(levels):
            seconds = window_seconds(args, stop_at, levels[index:])
            if time.monotonic() + seconds + WINDOW_OVERHEAD > stop_at:
                report["skipped"].append(f"{clients} clients")
                continue
            level = measure_level(log, server.base, clients, seconds, serial=100 + index)
            report["levels"].append(level)
            keys = ("tok_s", "j_per_token", "steady_j_per_token", "errors")
            print(clients, json.dumps({k: level[k] for k in keys} | level["steady"]), flush=True)
            save(report, log, args.out)
        a = time.monotonic() - log.t0
        time.sleep(max(0.0, min(args.cool_seconds, stop_at - time.monotonic() - 3)))
        report["cool"] = cool_tau(log.plant(), a, time.monotonic() - log.t0)
    finally:
        server.stop()
        log.stop()
        save(report, log, args.out)
    if report.get("idle"):
        print(markdown(report), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
