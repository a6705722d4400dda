"""Ember's runtime vs `llama-server` on an NVIDIA GPU, with NVML readings and the thermal governor.

Runs on the GPU machine after `bench/gpu_build.sh` (driver: `bench/gpu_run.sh`). Everything the
H200 run of issue 17 asks for, in priority order, each step skipped once `--deadline` seconds
would be exceeded (what was skipped is written to the results, not hidden):

1. `python -m ember_runtime.prewarm diagnose` (accelerator nvidia-gpu) on this machine;
2. per model (random-weight GGUFs in real shapes, `bench/gpu_models.py`; the 7-8B one first):
   Ember (all layers offloaded, `engine.maxBatchSize` = the most clients) then `llama-server`
   from the same build (`LLAMA_SERVER_FLAGS`), one after the other, at 1, 8, 32 and
   64 concurrent streaming clients of the CPU benchmark's load generator, its clients dealt
   over `CLIENT_PROCS` processes (`distinct` workload: ~62-token prompts, 64 tokens out,
   greedy; 8 requests per client): tok/s, TTFT and ITL p50/p99;
3. the thermal governor on real NVML readings: Ember with `throttleCelsius` a few degrees above
   the idle temperature under full load; the batch limit (`/metrics`) against the temperature
   (NVML, sampled here at 10 Hz) and the ITL, over time;

with NVML (temperature, power, SM clock) sampled through the whole run. Writes
`OUT/gpu_bench.{json,md,png}` and `OUT/gpu_thermal.png`.

    python bench/gpu_bench.py --llama-server BIN --models DIR --out DIR [--deadline S]

`--servers llama-server --previous OLD.json` reruns one server only and keeps the other's rows
(and the thermal run and diagnosis) from OLD.json, saying in the results which run each came
from: same build and machine kind, a fraction of the device time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_models import write_model
from bench.runtime_bench import (
    CTX_PER_SEQ,
    LevelResult,
    Server,
    free_port,
    one_request,
    request_body,
    run_level_procs,
)

LEVELS = (1, 8, 32, 64)
MAX_TOKENS = 64
THREADS = 8  # CPU threads for either server; with every layer on the GPU they only feed it
THERMAL_SECONDS = 75.0
# The load generator's clients are dealt over this many processes (the GPU machine has 16
# cores): one event loop parsing a 2,000 tok/s stream lags, and the lag reads as TTFT.
CLIENT_PROCS = 8


def requests_for(clients: int) -> int:
    """Enough requests for a p99 at every level, without spending minutes on one client: 8
    per client (at 3, a level's p99 was its single slowest request, the first wave's)."""
    return max(32, 8 * clients)


# --- NVML, sampled here independently of the runtime ------------------------------------------


@dataclass
class NvmlSample:
    t: float
    celsius: float
    watts: float
    sm_mhz: int
    util: int


class NvmlLog:
    """GPU 0's temperature, power, SM clock and utilisation every `interval` s on a thread."""

    def __init__(self, interval: float = 0.1) -> None:
        import pynvml

        self._nv = pynvml
        pynvml.nvmlInit()
        self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.name = str(pynvml.nvmlDeviceGetName(self._h))
        self.samples: list[NvmlSample] = []
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def read(self) -> NvmlSample:
        nv, h = self._nv, self._h
        return NvmlSample(
            round(time.monotonic() - self.t0, 3),
            float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            int(nv.nvmlDeviceGetUtilizationRates(h).gpu),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self._interval)

    def start(self) -> NvmlLog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict[str, float]:
        inside = [s for s in self.samples if start <= s.t <= end] or self.samples[-1:]
        return {
            "celsius_max": max(s.celsius for s in inside),
            "watts_mean": sum(s.watts for s in inside) / len(inside),
            "watts_max": max(s.watts for s in inside),
            "sm_mhz_mean": sum(s.sm_mhz for s in inside) / len(inside),
            "util_mean": sum(s.util for s in inside) / len(inside),
        }


# --- servers ----------------------------------------------------------------------------------


def ember_server(model: Path, slots: int, work: Path, thermal: dict[str, Any] | None) -> Server:
    port = free_port()
    config = {
        "modelName": model.stem,
        "modelDir": str(model.parent),
        "accelerator": "nvidia-gpu",  # every layer offloaded (engine.gpuLayers unset)
        "engine": {"maxBatchSize": slots, "contextLength": CTX_PER_SEQ, "threads": THREADS},
        "server": {"maxQueue": 1024, "host": "127.0.0.1", "port": port},
        # NVML only: the VM's own thermal zones must not steer the GPU's batch.
        "sensors": {"nvml": True, "intervalSeconds": 0.25, "zoneTypes": ["none"]},
        "thermal": thermal or {"maxBatchSize": slots, "minBatchSize": 1},
    }
    path = work / f"ember-{model.stem}-{'thermal' if thermal else 'bench'}.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(path)]
    argv += ["--model", str(model), "--log-level", "warning"]
    return Server("ember", argv, port)


def llama_server_flags(slots: int) -> list[str]:
    """llama-server set up as Ember is: every layer offloaded, one slot per client, one KV pool
    of 512 cells per slot. Its host-RAM prompt cache is off (`--cache-ram 0`; on by default,
    it copies every idle slot's KV out of the GPU whenever a request starts: Ember has no such
    cache), and so are context checkpoints (`--ctx-checkpoints 0`: copies of a sliding-window
    model's KV state during prompts, Gemma 3 here; Ember makes none)."""
    return [
        "-ngl", "999", "-t", str(THREADS), "-tb", str(THREADS), "-np", str(slots),
        "-c", str(CTX_PER_SEQ * slots), "-kvu", "--cache-ram", "0", "--ctx-checkpoints", "0",
    ]  # fmt: skip


def llama_server(binary: Path, model: Path, slots: int) -> Server:
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += [*llama_server_flags(slots), "--log-disable"]
    return Server("llama-server", argv, port)


def bench_server(server: Server, work: Path, nvml: NvmlLog) -> tuple[list[dict[str, Any]], float]:
    began = time.monotonic()
    server.start(work)
    load_s = time.monotonic() - began
    rows = []
    try:
        for clients in LEVELS:
            t0 = time.monotonic() - nvml.t0
            result: LevelResult = run_level_procs(
                server, "distinct", clients, requests_for(clients), CLIENT_PROCS
            )
            row = asdict(result) | {"nvml": nvml.window(t0, time.monotonic() - nvml.t0)}
            rows.append(row)
            print(
                f"  {server.name} {clients:>2} clients: {result.tok_s:7.1f} tok/s, TTFT p50/p99 "
                f"{result.ttft_p50 * 1e3:.0f}/{result.ttft_p99 * 1e3:.0f} ms, ITL p50/p99 "
                f"{result.itl_p50 * 1e3:.1f}/{result.itl_p99 * 1e3:.1f} ms, errors "
                f"{result.errors}",
                flush=True,
            )
        if server.name == "ember":
            rows[-1]["metrics_sample"] = gpu_metrics(server)
    finally:
        server.stop()
    return rows, load_s


def gpu_metrics(server: Server) -> list[str]:
    """The runtime's own NVML-fed lines in /metrics: the sensor path end to end."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    keys = ("ember_device_temperature", "ember_gpu_", "ember_max_batch_size")
    return [line for line in text.splitlines() if line.startswith(keys)]


# --- the governor on real readings --------------------------------------------------------------


@dataclass
class Point:
    t: float
    batch: float | None
    runtime_celsius: float | None


def scrape(client: httpx.Client) -> tuple[float | None, float | None]:
    batch = temp = None
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("ember_max_batch_size "):
            batch = float(line.split()[-1])
        elif line.startswith("ember_device_temperature_celsius{"):
            value = float(line.split()[-1])
            temp = value if temp is None else max(temp, value)
    return batch, temp


async def timed_load(server: Server, clients: int, seconds: float, t0: float) -> list[list[float]]:
    """`clients` streaming clients back to back for `seconds`; (time, gap) of every token gap."""
    gaps: list[list[float]] = []
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=server.base, timeout=600, limits=limits) as client:

        async def worker(index: int) -> None:
            i = index
            while time.monotonic() < stop_at:
                path, body = request_body("distinct", i, MAX_TOKENS)
                ended = time.monotonic()
                stats = await one_request(client, path, body)
                ended = time.monotonic()
                # The gaps end at the request's end: place them backwards from there.
                at = ended - t0
                for gap in reversed(stats.gaps):
                    gaps.append([round(at, 3), gap])
                    at -= gap
                i += clients

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return gaps


def thermal_run(
    model: Path, slots: int, work: Path, nvml: NvmlLog, margin: float
) -> dict[str, Any]:
    idle = nvml.read().celsius
    throttle = idle + margin
    policy = {
        "maxBatchSize": slots,
        "minBatchSize": 4,
        "throttleCelsius": throttle,
        "criticalCelsius": throttle + 40,
        "celsiusPerStep": 1.0,
        "hysteresisCelsius": 1.0,
    }
    server = ember_server(model, slots, work, policy)
    server.start(work)
    points: list[Point] = []
    stop = threading.Event()
    t0 = nvml.t0

    def poll() -> None:
        with httpx.Client(base_url=server.base, timeout=5) as client:
            while not stop.is_set():
                batch, temp = scrape(client)
                points.append(Point(round(time.monotonic() - t0, 3), batch, temp))
                stop.wait(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    began = time.monotonic() - t0
    poller.start()
    try:
        gaps = asyncio.run(timed_load(server, slots, THERMAL_SECONDS, t0))
        time.sleep(8)  # idle tail: the batch limit coming back as the GPU cools
    finally:
        stop.set()
        poller.join()
        server.stop()
    ended = time.monotonic() - t0
    samples = [asdict(s) for s in nvml.samples if began <= s.t <= ended]
    crossed = next((s["t"] for s in samples if s["celsius"] >= throttle), None)
    # The policy keeps the full batch at exactly the line (floor(0 / step) = 0 steps): the first
    # reading that asks for a smaller batch is one step above it.
    stepped = next((s["t"] for s in samples if s["celsius"] >= throttle + 1.0), None)
    lowered = next(
        (p.t for p in points if p.batch is not None and p.batch < slots and p.t >= began), None
    )
    return {
        "idle_celsius": idle,
        "policy": policy,
        "began": began,
        "ended": ended,
        "nvml": samples,
        "runtime": [asdict(p) for p in points],
        # Every n-th gap only: 75 s at ~2,000 tok/s is 160k gaps (5 MB of JSON) for one plot.
        "itl": gaps[:: (thin := max(1, len(gaps) // 8000))],
        "itl_note": f"every {thin}th token gap (time, seconds) of {len(gaps)}",
        "crossed_at": crossed,
        "batch_lowered_at": lowered,
        "reaction_s": None if crossed is None or lowered is None else round(lowered - crossed, 3),
        "step_reading_at": stepped,
        "reaction_from_step_s": None
        if stepped is None or lowered is None
        else round(lowered - stepped, 3),
        "peak_celsius": max((s["celsius"] for s in samples), default=None),
        "min_batch": min((p.batch for p in points if p.batch is not None), default=None),
    }


# --- diagnose ---------------------------------------------------------------------------------


def diagnose(model: Path, work: Path) -> dict[str, Any]:
    import hashlib

    digest = hashlib.sha256()
    with model.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    config = {
        "modelName": model.stem,
        "modelDir": str(model.parent),
        "files": [
            {"path": model.name, "sha256": digest.hexdigest(), "sizeBytes": model.stat().st_size}
        ],
        "prewarmDir": "/dev/shm/ember-prewarm",
        "accelerator": "nvidia-gpu",
        "sensors": {"nvml": True},
    }
    path = work / "diagnose.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "ember_runtime.prewarm", "diagnose", "--config", str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    print(out.stdout, out.stderr[-2000:], flush=True)
    return {"exit": out.returncode, "table": out.stdout, "stderr": out.stderr[-2000:]}


# --- report -----------------------------------------------------------------------------------


def verdict(runs: dict[str, dict[str, list[dict[str, Any]]]], model: str) -> list[str]:
    lines = []
    ember = {r["clients"]: r for r in runs.get(model, {}).get("ember", [])}
    peer = {r["clients"]: r for r in runs.get(model, {}).get("llama-server", [])}
    for clients in (8, 32, 64):
        e, p = ember.get(clients), peer.get(clients)
        if e is None or p is None:
            lines.append(f"- {model}, {clients} clients: not measured")
            continue
        ratio = e["tok_s"] / p["tok_s"]
        ok_rate = "met" if ratio >= 1.0 else "missed"
        ok_ttft = "met" if e["ttft_p99"] <= p["ttft_p99"] else "missed"
        lines.append(
            f"- {model}, {clients} clients: tok/s {e['tok_s']:.0f} vs {p['tok_s']:.0f} = "
            f"{ratio:.2f}x (goal >= 1.0x: {ok_rate}); TTFT p99 {e['ttft_p99'] * 1e3:.0f} vs "
            f"{p['ttft_p99'] * 1e3:.0f} ms (goal <=: {ok_ttft})"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    out = [
        f"# GPU benchmark: Ember vs llama-server on {report['gpu']}",
        "",
        f"llama.cpp from llama-cpp-python {report['llama_cpp_python']}'s sources, CUDA sm_90, "
        "one build for both servers. Random-weight GGUFs in real shapes (`bench/gpu_models.py`); "
        f"`distinct` workload: ~62-token prompts, {MAX_TOKENS} tokens out, greedy; "
        f"{CTX_PER_SEQ} tokens of context per slot; slots = {max(LEVELS)}. The load "
        f"generator's clients are dealt over {CLIENT_PROCS} processes, the same for both servers; "
        "each client opens its connection with a throw-away `GET /v1/models` before the clock "
        "starts (a fresh process's first request cost 110-170 ms of its own).",
        "",
        "| model | server | clients | requests | tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | errors | GPU °C max | W mean | SM MHz mean | util % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, servers in report["runs"].items():
        for server, rows in servers.items():
            run = report.get("row_runs", {}).get(f"{model}/{server}", "")
            for r in rows:
                n = r["nvml"]
                out.append(
                    f"| {model} | {server}{f' ({run})' if run else ''} | {r['clients']} "
                    f"| {r['requests']} | {r['tok_s']:.1f} "
                    f"| {r['ttft_p50'] * 1e3:.1f} | {r['ttft_p99'] * 1e3:.1f} "
                    f"| {r['itl_p50'] * 1e3:.2f} | {r['itl_p99'] * 1e3:.2f} | {r['errors']} "
                    f"| {n['celsius_max']:.0f} | {n['watts_mean']:.0f} | {n['sm_mhz_mean']:.0f} "
                    f"| {n['util_mean']:.0f} |"
                )
    out += ["", f"llama-server flags: `{' '.join(report['llama_server_flags'])}`."]
    prev = report.get("previous")
    if prev:
        out += [
            "",
            f"Rows marked ({prev['name'] or 'previous run'}) are from an earlier run on the same "
            f"build and machine kind (its llama-server flags: `{prev['llama_server_flags']}`); "
            "the others from this one.",
        ]
    out += ["", "## Goals (issue 17)", ""]
    out += verdict(report["runs"], "llama-8b")
    out += ["", "270M (not a goal; what limits it is per-token overhead):", ""]
    out += verdict(report["runs"], "gemma3-270m")
    th = report.get("thermal")
    if th:
        out += [
            "",
            "## Thermal governor on real NVML readings",
            "",
            f"Idle {th['idle_celsius']:.0f} °C, throttle line {th['policy']['throttleCelsius']:.0f}"
            f" °C, 1 °C per batch step; peak {th['peak_celsius']} °C, smallest batch "
            f"{th['min_batch']}. Crossed the line at t={th['crossed_at']} s (NVML, 10 Hz), batch "
            f"lowered at t={th['batch_lowered_at']} s (`/metrics`, ~3 Hz): "
            f"{th['reaction_s']} s after the first reading at the line, which the policy maps "
            f"to the full batch (floor(0/step) = 0); the first reading one step above it (the "
            f"first that asks for a smaller batch) came at t={th.get('step_reading_at')} s: "
            f"reaction {th.get('reaction_from_step_s')} s (goal <= 1 s: "
            f"{'met' if (th.get('reaction_from_step_s') or 99) <= 1 else 'missed'}).",
        ]
    out += ["", "## Steps skipped for time", ""]
    out += [f"- {s}" for s in report["skipped"]] or ["- none"]
    if report.get("diagnose"):
        out += ["", "## `python -m ember_runtime.prewarm diagnose`", "", "```"]
        out += [report["diagnose"]["table"].rstrip(), "```"]
    return "\n".join(out) + "\n"


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    if runs:
        fig, axes = plt.subplots(len(runs), 3, figsize=(15, 4 * len(runs)), squeeze=False)
        for row, (model, servers) in enumerate(runs.items()):
            for server, rows in servers.items():
                x = [r["clients"] for r in rows]
                axes[row][0].plot(x, [r["tok_s"] for r in rows], marker="o", label=server)
                axes[row][1].plot(x, [r["ttft_p99"] * 1e3 for r in rows], marker="o", label=server)
                axes[row][2].plot(x, [r["itl_p99"] * 1e3 for r in rows], marker="o", label=server)
            for ax, title in zip(
                axes[row], ("tok/s", "TTFT p99 (ms)", "ITL p99 (ms)"), strict=True
            ):
                ax.set_title(f"{model}: {title}")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("concurrent clients")
                ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gpu_bench.png", dpi=90)
    th = report.get("thermal")
    if th:
        fig, ax = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        ax[0].plot([s["t"] for s in th["nvml"]], [s["celsius"] for s in th["nvml"]], label="NVML")
        ax[0].axhline(th["policy"]["throttleCelsius"], color="r", ls="--", label="throttle")
        ax[0].set_ylabel("GPU °C")
        ax[0].legend()
        pts = [p for p in th["runtime"] if p["batch"] is not None]
        ax[1].step([p["t"] for p in pts], [p["batch"] for p in pts], where="post")
        ax[1].set_ylabel("batch limit")
        ax[2].plot([g[0] for g in th["itl"]], [g[1] * 1e3 for g in th["itl"]], ",", alpha=0.4)
        ax[2].set_ylabel("ITL (ms)")
        ax[2].set_xlabel("seconds")
        for a in ax:
            if th["crossed_at"] is not None:
                a.axvline(th["crossed_at"], color="grey", ls=":")
        fig.suptitle("Thermal governor on real NVML readings (H200, 8B-shaped model, 64 clients)")
        fig.tight_layout()
        fig.savefig(out / "gpu_thermal.png", dpi=90)


# --- main -------------------------------------------------------------------------------------


def keep_previous(
    report: dict[str, Any], old: dict[str, Any], servers: list[str], args: argparse.Namespace
) -> None:
    """Carry the rows of the servers this run skips (and, without Ember, the thermal run and
    the diagnosis) from an earlier run, labelled so the table says which run each row is from."""
    report["row_runs"] = {}
    for model, rows_by_server in old.get("runs", {}).items():
        for server, rows in rows_by_server.items():
            if server not in servers:
                report["runs"].setdefault(model, {})[server] = rows
                report["row_runs"][f"{model}/{server}"] = args.previous_name or "previous run"
                seconds = old.get("load_seconds", {}).get(f"{model}/{server}")
                if seconds is not None:
                    report["load_seconds"][f"{model}/{server}"] = seconds
    for model in args.only.split(","):
        for server in servers:
            report["row_runs"][f"{model}/{server}"] = args.run_name or "this run"
    if "ember" not in servers:
        for key in ("thermal", "diagnose"):
            if key in old:
                report[key] = old[key]
    report["previous"] = {
        "name": args.previous_name,
        "llama_server_flags": old.get(
            "llama_server_flags", "-ngl 999 -t 8 -tb 8 -np 64 -c 32768 -kvu"
        ),
        "idle": old.get("idle"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start")
    ap.add_argument("--only", default="llama-8b,gemma3-270m")
    ap.add_argument("--thermal-margin", type=float, default=4.0)
    ap.add_argument("--servers", default="ember,llama-server")
    ap.add_argument("--previous", type=Path, help="keep the rows of servers not rerun from here")
    ap.add_argument("--run-name", default="", help="label of this run's rows (with --previous)")
    ap.add_argument("--previous-name", default="", help="label of the kept rows")
    args = ap.parse_args()
    stop_at = time.monotonic() + args.deadline
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    nvml = NvmlLog().start()
    import llama_cpp

    report: dict[str, Any] = {
        "gpu": nvml.name,
        "llama_cpp_python": llama_cpp.__version__,
        "idle": asdict(nvml.read()),
        "runs": {},
        "load_seconds": {},
        "skipped": [],
        "llama_server_flags": llama_server_flags(max(LEVELS)),
    }
    servers = args.servers.split(",")
    if args.previous is not None:
        keep_previous(report, json.loads(args.previous.read_text()), servers, args)

    def left() -> float:
        return float(stop_at - time.monotonic())

    def save() -> None:
        report["nvml_trace"] = [asdict(s) for s in nvml.samples[::5]]
        (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
        (args.out / "gpu_bench.md").write_text(markdown(report))

    slots = max(LEVELS)
    models = {}
    try:
        for name in args.only.split(","):
            models[name] = write_model(name, args.models)
        if "ember" in servers:
            report["diagnose"] = diagnose(models[args.only.split(",")[-1]], work)
        for index, (name, model) in enumerate(models.items()):
            candidates = (
                ember_server(model, slots, work, None),
                llama_server(args.llama_server, model, slots),
            )
            for server in (c for c in candidates if c.name in servers):
                need = 150 if name == "llama-8b" else 90
                thermal_next = index == 0 and "ember" in servers
                if left() < need + (100 if thermal_next else 0):
                    report["skipped"].append(f"{name}: {server.name} ({left():.0f} s left)")
                    continue
                print(f"{name}: {server.name}", flush=True)
                rows, load_s = bench_server(server, work, nvml)
                report["runs"].setdefault(name, {})[server.name] = rows
                report["load_seconds"][f"{name}/{server.name}"] = round(load_s, 1)
                save()
            if index == 0 and "ember" in servers:
                if left() > THERMAL_SECONDS + 40:
                    print("thermal governor run", flush=True)
                    report["thermal"] = thermal_run(model, slots, work, nvml, args.thermal_margin)
                    save()
                else:
                    report["skipped"].append(f"thermal run ({left():.0f} s left)")
    finally:
        nvml.stop()
        save()
        plot(report, args.out)
    print(markdown(report), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
