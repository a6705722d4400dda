"""Ember's runtime vs `llama-server` at its best on an NVIDIA GPU (issues 33 and 46): greedy,
sampled and client-default sampling in one call, with NVML readings (and, optionally, the
thermal governor).

Runs on the GPU machine after `bench/gpu_build.sh` (driver: `bench/gpu_run.sh`). Per model
(random-weight GGUFs in real shapes, `bench/gpu_models.py`; by default only the 8B shape, which
the goals are about), three servers from the same llama.cpp build are started once and stay up
for the whole call: Ember (all layers offloaded, `engine.maxBatchSize` = the most clients, its
sampler chain on the GPU), `llama-server` (`llama_server_flags`: its sampler chain on the host)
and `llama-server --backend-sampling` (its sampler chain on the GPU, in the decode's graph). An
idle server holds GPU memory, not compute (~9 GiB each for the 8B shape), and an H100's 80 GB
holds all three. Then, all in this one call, so every ratio pairs readings minutes apart on one
machine (three calls of one workload each read plain llama-server at 32 clients as 992, 1,017
and 1,541 tok/s: across calls a ratio measures the machine):

* workloads (`--workloads`, each `shape/sampling` of `bench/runtime_bench.py`): `distinct/greedy`
  (temperature 0), `distinct/sampled` (temperature 0.8, top_p 0.95) and
  `distinct/client-defaults` (no sampling field: each server samples with its own defaults);
  ~62-token distinct prompts, 64 tokens out; every server gets the same request bodies
  (`runtime_bench.request_body`), streaming with usage, tokens counted from each stream's usage;
* levels of 8, 32 and 64 concurrent streaming clients, each run for `--level-seconds` (10):
  every client sends requests back to back until the deadline; the requests in flight then
  finish and count; tok/s = tokens / (last request's end - the common start). The clients are
  dealt over `CLIENT_PROCS` processes and each opens its connection before the clock starts;
* order: for each workload, for each of `--reps` (1) repeats, for each level, every server in
  turn, the order rotating by one server each level. Each level's requests carry a serial of
  their own (the same for every server), so no prompt repeats within a server's run and no
  prefix cache serves one;
* the peer at its best, for every workload greedy included: both llama-server configurations
  run every level, and each level's verdict takes the faster of the two (tok/s; its TTFT with
  it). `--no-backend-sampling` leaves the second out;
* the baseline repeated: plain llama-server, `distinct/greedy`, 32 clients (`BASELINE`), before
  every workload and once at the end; its spread over the call is printed beside each verdict
  (a ratio nearer its goal than that spread is within the machine's own drift);
* output texts: after each workload's levels, per server, the same prompt three times with no
  seed (as the benchmark sends it) and twice with `seed` 7, not streamed: the texts and seeds go
  into the JSON, and the markdown counts the distinct texts (greedy: 1 of 3; sampled: 3 of 3);
* then, in what time is left, unless `--skip-thermal` / `--skip-diagnose`: the thermal governor
  on real NVML readings after the first model (Ember with `throttleCelsius` a few degrees above
  idle, 64 clients for 75 s: the batch limit from `/metrics` against NVML's temperature and the
  ITL over time) and `python -m ember_runtime.prewarm diagnose`.

NVML (temperature, power, SM clock, utilisation) is sampled at 10 Hz through the whole call.
Every repeat (all its levels) and every step starts only if it fits in what is left of
`--deadline` seconds; what did not is listed in the results, not hidden. Writes
`OUT/gpu_bench.{json,md,png}` (and `OUT/gpu_thermal.png` when the report holds a thermal run,
whose data is the JSON's `thermal`): per (model, workload, server, clients) the per-repeat rows
in the JSON; in the markdown the median and range (min-max) over the repeats, what each server
sampled with, and the goals as met/missed with their ratios.

    python bench/gpu_bench.py --llama-server BIN --models DIR --out DIR [--deadline S]
        [--workloads W,...] [--reps 1] [--level-seconds 10] [--no-backend-sampling]
        [--skip-thermal] [--skip-diagnose] [--only llama-8b] [--previous OLD.json]

One call, all three workloads: ~20-50 s in gpu_run.sh (wheels, the carried build unpacked),
~30 s to write the 8B GGUF (none when a warm machine has it), ~10 s to start the three servers,
then 3 workloads x 3 levels x 3 servers + 4 baseline readings = 31 levels of ~13 s (10 s, ~1 s
to fork the client processes and open their connections, ~1-2 s of requests in flight at the
deadline) = ~400 s, and ~15 s of output texts: ~8.5 min of gpu_run.sh's 590 s (the device
tool's limit is 600 s). The thermal run (~90 s) and the diagnosis then run only if time is
left; a call of its own runs them (`--workloads= ` with `--previous`, docs/gpu.md).
`--previous OLD.json` keeps OLD.json's rows of the (model, workload) pairs this call does not
measure, its baseline readings, and its thermal run and diagnosis where this call has none:
the JSON lists every call (`calls`: when, with what arguments, what was skipped) and each
workload's rows say which call measured them, as does the markdown.

Through `bench/gpu_run.sh` and the device tool (each call runs on a fresh copy of the repo,
with `carry: [".gpu"]` and `timeout_s: 600`; only `$OUT`'s files come back; FILES_AT below is
where the tool puts them), from the repo root:

    python bench/gpu_prepare.py --out .gpu      # rebuilds .gpu from scratch: art/, prev/ too
    # call 1 (~6 min): the CUDA build only (or BENCH=plant: the build, then bench/gpu_plant.py)
    GPU_DIR=.gpu OUT=$OUT BENCH=build bash .gpu/wt/bench/gpu_run.sh 590
    python bench/gpu_prepare.py --out .gpu --art FILES_AT
    # call 2 (~9 min): the comparison, every workload
    GPU_DIR=.gpu OUT=$OUT bash .gpu/wt/bench/gpu_run.sh 590
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_models import write_model
from bench.runtime_bench import (
    CTX_PER_SEQ,
    SAMPLED_WITH,
    SAMPLING,
    SHAPES,
    LevelResult,
    RequestStats,
    Server,
    _level_result,
    one_request,
    request_body,
    run_clients,
)
from tests.support.net import free_port

LEVELS: tuple[int, ...] = (8, 32, 64)
# Ember's engine.deviceSampling is `auto`: every layer offloaded, so each request's chain runs
# in llama_decode on the GPU (engines/device_sampling.py).
EMBER_WHERE = ", its sampler chain on the GPU (engine.deviceSampling auto)"
MAX_TOKENS = 64
THREADS = 8  # CPU threads for either server; with every layer on the GPU they only feed it
THERMAL_SECONDS = 75.0
DIAGNOSE_SECONDS = 60.0  # what the diagnosis needs (the model hashed, then read): else skipped
# The load generator's clients are dealt over this many processes (the GPU machine has 16
# cores): one event loop parsing a 2,000 tok/s stream lags, and the lag reads as TTFT.
CLIENT_PROCS = 8
WORKLOADS = ("distinct/greedy", "distinct/sampled", "distinct/client-defaults")
EMBER = "ember"
PEER = "llama-server"
PEER_BS = "llama-server --backend-sampling"
# Its n-gram speculation (issue 48), host sampling: the pinned build's speculative path.
SPEC_FLAGS = ("--spec-type", "ngram-simple")
PEER_SPEC = "llama-server " + " ".join(SPEC_FLAGS)
PEERS = (PEER, PEER_BS, PEER_SPEC)
# The reading repeated through the call (before every workload, and at its end): plain
# llama-server, greedy, 32 clients, the cell three calls once read as 992, 1,017 and 1,541.
BASELINE = (PEER, "distinct/greedy", 32)
# The output texts kept per workload and server: no seed three times (as the benchmark's
# requests), then one seed twice (a seeded draw repeats on one server).
SAMPLE_SEEDS: tuple[int | None, ...] = (None, None, None, 7, 7)
START_DELAY = 1.0  # s from a level's forks to its common start: processes up, connections open
# A level's seconds beyond its duration (the forks and connections, the requests in flight at
# the deadline, the pool's end), for the deadline's arithmetic.
LEVEL_OVERHEAD = 3.0


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
        # The batch ceiling is engine.maxBatchSize alone (contract.thermal); the policy has none.
        "thermal": thermal or {"minBatchSize": 1},
    }
    path = work / f"ember-{model.stem}-{'thermal' if thermal else 'bench'}.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(path)]
    argv += ["--model", str(model), "--log-level", "warning"]
    return Server(EMBER, argv, port)


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


def llama_server(binary: Path, model: Path, slots: int, name: str = PEER) -> Server:
    """`name` picks the configuration: PEER_BS runs its sampler chain on the GPU, in the
    decode's graph (`--backend-sampling`, experimental in this build), instead of on the CPU
    after it; PEER_SPEC drafts from n-grams of the prompt and the text so far."""
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += [*llama_server_flags(slots), "--log-disable"]
    if name == PEER_BS:
        argv.append("--backend-sampling")
    elif name == PEER_SPEC:
        argv += SPEC_FLAGS
    return Server(name, argv, port)


class Fleet:
    """One model's servers, each started on first use and kept up for the whole call (an idle
    server holds GPU memory, not compute, and an H100 holds all three)."""

    def __init__(self, binary: Path, model: Path, slots: int, work: Path) -> None:
        self.work = work
        self.makers: dict[str, Callable[[], Server]] = {
            EMBER: lambda: ember_server(model, slots, work, None),
            **{name: functools.partial(llama_server, binary, model, slots, name) for name in PEERS},
        }
        self.up: dict[str, Server] = {}
        self.load_seconds: dict[str, float] = {}

    def get(self, name: str) -> Server:
        if name not in self.up:
            server = self.makers[name]()
            began = time.monotonic()
            try:
                server.start(self.work)
            except BaseException:
                server.stop()
                raise
            self.load_seconds[name] = round(time.monotonic() - began, 1)
            self.up[name] = server
        return self.up[name]

    def stop(self, name: str) -> None:
        server = self.up.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.up):
            self.stop(name)


def gpu_metrics(server: Server) -> list[str]:
    """The runtime's own NVML-fed lines in /metrics: the sensor path end to end."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    keys = ("ember_device_temperature", "ember_gpu_", "ember_max_batch_size")
    return [line for line in text.splitlines() if line.startswith(keys)]


# --- a level: clients back to back for a duration -----------------------------------------------


async def _clients_for(
    base: str,
    workload: str,
    clients: int,
    indices: list[int],
    *,
    serial: int,
    window: tuple[float, float],
) -> tuple[list[RequestStats], list[str], float]:
    """Clients `indices` (of `clients` in the level), each sending requests back to back from
    `window[0]` until `window[1]` (wall clock; connections are opened before the start); the
    requests in flight at the end finish and count. Returns their stats, what the failed ones
    said, and when the last one ended."""
    start_at, stop_at = window
    return await run_clients(
        base,
        workload,
        clients,
        indices,
        more=lambda _turn: time.time() < stop_at,
        serial=serial,
        start_at=start_at,
    )


def _clients_process(
    args: tuple[str, str, int, list[int], int, tuple[float, float]],
) -> tuple[list[RequestStats], list[str], float]:
    base, workload, clients, indices, serial, window = args
    return asyncio.run(_clients_for(base, workload, clients, indices, serial=serial, window=window))


def run_level_for(
    server: Server, workload: str, clients: int, seconds: float, serial: int
) -> LevelResult:
    """`clients` clients back to back for `seconds`, dealt over `CLIENT_PROCS` forked
    processes (as `runtime_bench.run_level_procs`, which sends a count of requests instead)
    that all start together; tok/s over the wall from that start to the last request's end.
    `serial` goes into every prompt (`request_body`'s `level`): one per level, the same for
    every server."""
    import multiprocessing

    procs = max(1, min(CLIENT_PROCS, clients))
    start_at = time.time() + START_DELAY
    window = (start_at, start_at + seconds)
    jobs = [
        (server.base, workload, clients, list(range(clients))[p::procs], serial, window)
        for p in range(procs)
    ]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_clients_process, jobs)
    stats = [s for part in parts for s in part[0]]
    failures = [f for part in parts for f in part[1]]
    wall = max(1e-6, max(part[2] for part in parts) - start_at)
    return _level_result(server, workload, clients, wall, (stats, failures))


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


def diagnose(model: Path, work: Path, timeout: float = 120.0) -> dict[str, Any]:
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
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"exit": None, "table": f"timed out after {timeout:.0f} s", "stderr": ""}
    print(out.stdout, out.stderr[-2000:], flush=True)
    return {"exit": out.returncode, "table": out.stdout, "stderr": out.stderr[-2000:]}


# --- the call: workloads x repeats x levels x servers --------------------------------------------


def is_greedy(workload: str) -> bool:
    return workload.partition("/")[2] in ("", "greedy")


@dataclass
class Call:
    """One call's state: the report being written, the deadline, the rotation and serials."""

    args: argparse.Namespace
    report: dict[str, Any]
    nvml: NvmlLog
    stop_at: float
    index: int = 1  # this call's number among the report's calls (1 without --previous)
    step: int = 0  # the servers' rotation: advances by one every level
    serial: int = 0  # the last level's serial (its prompts' `request_body` level)
    record: dict[str, Any] = field(default_factory=dict)  # this call's entry in report["calls"]

    def left(self) -> float:
        return float(self.stop_at - time.monotonic())

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds

    def level_cost(self) -> float:
        return float(self.args.level_seconds) + LEVEL_OVERHEAD

    def skip(self, what: str) -> None:
        note = f"{what} ({self.left():.0f} s left)"
        print(f"skipped: {note}", flush=True)
        self.record["skipped"].append(note)

    def rotate(self, servers: list[Server]) -> list[Server]:
        order = servers[self.step % len(servers) :] + servers[: self.step % len(servers)]
        self.step += 1
        return order

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def measure(
        self, server: Server, workload: str, clients: int, serial: int, rep: int
    ) -> dict[str, Any]:
        """One level of one server; `rep` 0 is a baseline reading."""
        t0 = time.monotonic() - self.nvml.t0
        r = run_level_for(server, workload, clients, self.args.level_seconds, serial)
        window = self.nvml.window(t0, time.monotonic() - self.nvml.t0)
        print(
            f"  {workload} {f'rep {rep}' if rep else 'baseline'} {r.server} {clients:>2} "
            f"clients: {r.tok_s:7.1f} tok/s, "
            f"TTFT p50/p99 {r.ttft_p50 * 1e3:.0f}/{r.ttft_p99 * 1e3:.0f} ms, ITL p50/p99 "
            f"{r.itl_p50 * 1e3:.1f}/{r.itl_p99 * 1e3:.1f} ms, {r.requests} requests, errors "
            f"{r.errors}",
            flush=True,
        )
        extra = {
            "rep": rep,
            "serial": serial,
            "seconds": self.args.level_seconds,
            "call": self.index,
        }
        return {**asdict(r), **extra, "nvml": window}

    def save(self) -> None:
        self.record["nvml_trace"] = [asdict(s) for s in self.nvml.samples[::5]]
        out = self.args.out
        (out / "gpu_bench.json").write_text(json.dumps(self.report, indent=1))
        (out / "gpu_bench.md").write_text(markdown(self.report))


def servers_of(call: Call, fleet: Fleet) -> list[Server]:
    """Ember and both llama-server configurations (the peer at its best is chosen per level
    from their readings); a configuration that does not start is skipped, not fatal."""
    names = [EMBER, PEER, *([PEER_BS] if call.args.backend_sampling else [])]
    names += [PEER_SPEC] if call.args.spec_peer else []
    up = []
    for name in names:
        try:
            up.append(fleet.get(name))
        except RuntimeError as exc:
            call.skip(f"{name} did not start: {exc}")
    return up


def baseline_reading(call: Call, fleet: Fleet, model: str, before: str) -> None:
    """One `BASELINE` level, labelled with the workload it precedes ('end' after the last)."""
    name, workload, clients = BASELINE
    if name not in fleet.up:
        return
    if not call.fits(call.level_cost()):
        call.skip(f"{model}: baseline reading before {before}")
        return
    row = call.measure(fleet.up[name], workload, clients, call.next_serial(), 0)
    call.report.setdefault("baseline", {}).setdefault(model, []).append(row | {"before": before})
    call.save()


async def _sample_texts(base: str, workload: str, serial: int) -> list[dict[str, Any]]:
    """The same prompt `SAMPLE_SEEDS` times, not streamed, one by one, after once more unkept:
    alone in the batch and each meeting the prompt in the server's prefix cache, a greedy text
    repeats exactly (on the CPU, sent together, the batch's shape moved one of three greedy
    texts on either server, and Ember's first, uncached, differed from the cached ones). Each:
    its seed (None: the server's own RNG) and its text."""
    path, body = request_body(workload, 0, MAX_TOKENS, serial)
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}

    async def one(client: httpx.AsyncClient, seed: int | None) -> dict[str, Any]:
        sent = body if seed is None else {**body, "seed": seed}
        response = await client.post(path, json=sent)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        return {"seed": seed, "text": text}

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        await one(client, None)
        return [await one(client, seed) for seed in SAMPLE_SEEDS]


def sample_texts(call: Call, servers: list[Server], workload: str) -> dict[str, Any]:
    """Every server's texts for one prompt of `workload` (`_sample_texts`), or why none."""
    if not call.fits(4.0 * len(servers)):
        call.skip(f"{workload}: output texts")
        return {}
    serial = call.next_serial()
    texts: dict[str, Any] = {}
    for server in servers:
        try:
            texts[server.name] = asyncio.run(_sample_texts(server.base, workload, serial))
        except (httpx.HTTPError, KeyError, IndexError) as exc:
            texts[server.name] = [{"error": f"{type(exc).__name__}: {exc}"[:200]}]
    return texts


def run_workload(call: Call, fleet: Fleet, model: str, workload: str) -> None:
    """The repeats of every level on every server, then the output texts; the entry replaces a
    previous call's of this (model, workload) once it holds a row."""
    entry: dict[str, Any] = {"call": call.index, "rows": [], "samples": {}}
    servers = servers_of(call, fleet)
    entry["servers"] = [s.name for s in servers]

    def publish() -> None:
        call.report["runs"].setdefault(model, {})[workload] = entry
        call.save()

    reps = int(call.args.reps)
    for rep in range(1, reps + 1):
        if not call.fits(len(LEVELS) * len(servers) * call.level_cost()):
            call.skip(f"{model} {workload}: repeat{f's {rep}-{reps}' if rep < reps else f' {rep}'}")
            break
        for clients in LEVELS:
            serial = call.next_serial()
            for server in call.rotate(servers):
                entry["rows"].append(call.measure(server, workload, clients, serial, rep))
                publish()
    if entry["rows"]:
        entry["samples"] = sample_texts(call, servers, workload)
        publish()


def bench_model(call: Call, name: str, model: Path, workloads: list[str]) -> None:
    """Every workload on one model, its servers up for all of them, the baseline read before
    each workload and at the end."""
    need = len(LEVELS) * 3 * call.level_cost() + 30  # the servers' start and one repeat
    if not workloads or not call.fits(need):
        if workloads:
            call.skip(f"{name}: every workload")
        return
    fleet = Fleet(call.args.llama_server, model, max(LEVELS), call.args.out / "work")
    try:
        servers_of(call, fleet)  # every server up before any level, for the whole call
        for workload in workloads:
            print(f"{name}: {workload}", flush=True)
            baseline_reading(call, fleet, name, workload)
            run_workload(call, fleet, name, workload)
        baseline_reading(call, fleet, name, "end")
        if EMBER in fleet.up:
            call.report.setdefault("metrics_sample", {})[name] = gpu_metrics(fleet.up[EMBER])
    finally:
        for server, seconds in fleet.load_seconds.items():
            call.record["load_seconds"][f"{name}/{server}"] = seconds
        fleet.stop_all()


def plan_seconds(args: argparse.Namespace, workloads: list[str]) -> float:
    """What the levels of one model take, by `LEVEL_OVERHEAD`'s estimate: printed up front."""
    cost = float(args.level_seconds) + LEVEL_OVERHEAD
    servers = 3 if args.backend_sampling else 2
    cells = len(workloads) * int(args.reps) * len(LEVELS) * servers
    return (cells + len(workloads) + 1) * cost


# --- report -----------------------------------------------------------------------------------

Row = dict[str, Any]
# The per-repeat figures summarised as median (min-max): key, scale, format.
METRICS = (
    ("tok_s", 1.0, "{:.0f}"),
    ("ttft_p50", 1e3, "{:.1f}"),
    ("ttft_p99", 1e3, "{:.1f}"),
    ("itl_p50", 1e3, "{:.2f}"),
    ("itl_p99", 1e3, "{:.2f}"),
)


def groups(rows: list[Row]) -> dict[tuple[str, int], list[Row]]:
    """Rows by (server, clients): Ember, llama-server, llama-server --backend-sampling."""
    rank = {name: i for i, name in enumerate((EMBER, *PEERS))}
    out: dict[tuple[str, int], list[Row]] = {}
    for r in sorted(rows, key=lambda r: (rank.get(r["server"], len(rank)), r["clients"])):
        out.setdefault((r["server"], r["clients"]), []).append(r)
    return out


def median(rows: list[Row], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def spread(rows: list[Row], key: str, scale: float, fmt: str) -> str:
    """`median (min-max)` over the repeats."""
    values = [r[key] * scale for r in rows]
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}–{high})" if len(values) > 1 else mid


def nvml_means(rows: list[Row]) -> str:
    n = [r["nvml"] for r in rows]
    hottest = max(x["celsius_max"] for x in n)
    means = [sum(x[k] for x in n) / len(n) for k in ("watts_mean", "sm_mhz_mean", "util_mean")]
    return f"{hottest:.0f} | {means[0]:.0f} | {means[1]:.0f} | {means[2]:.0f}"


def table(runs: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "| model | workload | server | clients | reps | requests/rep | tok/s | TTFT p50 (ms) "
        "| TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | errors | GPU °C max | W mean "
        "| SM MHz mean | util % | call |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, by_workload in runs.items():
        for workload, entry in by_workload.items():
            for (server, clients), rows in groups(entry["rows"]).items():
                cells = " | ".join(spread(rows, k, s, f) for k, s, f in METRICS)
                out.append(
                    f"| {model} | {workload} | {server} | {clients} | {len(rows)} "
                    f"| {median(rows, 'requests'):.0f} | {cells} "
                    f"| {sum(r['errors'] for r in rows)} | {nvml_means(rows)} "
                    f"| {calls_of(rows, entry)} |"
                )
    return out


def calls_of(rows: list[Row], entry: dict[str, Any]) -> str:
    """The calls that measured these rows (an entry of an older file may span calls)."""
    return ", ".join(str(c) for c in sorted({r.get("call", entry["call"]) for r in rows}))


def sampled_with(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What each server sampled with, per workload measured."""
    out = []
    servers = {w: e.get("servers") for by_workload in runs.values() for w, e in by_workload.items()}
    for workload, names in servers.items():
        mode = workload.partition("/")[2] or "greedy"
        body = json.dumps(SAMPLING[mode]) if SAMPLING[mode] else "no sampling field"
        peers = [
            f"{name} {SAMPLED_WITH['llama-server'][mode]}, its sampler chain on the "
            f"{'GPU' if name == PEER_BS else 'host'}"
            for name in PEERS
            if names is None or name in names
        ]
        out.append(
            f"- {workload} (request: {body}): Ember {SAMPLED_WITH['ember'][mode]}{EMBER_WHERE}; "
            + "; ".join(peers)
        )
    return out


def level_median(entry: dict[str, Any] | None, server: str, clients: int, key: str) -> float:
    """The median over the repeats of one server's level; 0 where it was not measured."""
    if entry is None:
        return 0.0
    rows = [r for r in entry["rows"] if r["server"] == server and r["clients"] == clients]
    return median(rows, key) if rows else 0.0


def best_peer(entry: dict[str, Any], clients: int) -> str | None:
    """The faster llama-server configuration at this level (median tok/s): the peer at its
    best; None where neither was measured."""
    speeds = {name: level_median(entry, name, clients, "tok_s") for name in PEERS}
    measured = {name: v for name, v in speeds.items() if v}
    return max(measured, key=lambda name: measured[name]) if measured else None


def peer_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per workload and level, both llama-server configurations' tok/s and which was faster."""
    out = []
    for model, by_workload in runs.items():
        for workload, entry in by_workload.items():
            cells = []
            for clients in LEVELS:
                best = best_peer(entry, clients)
                speeds = " vs ".join(
                    f"{level_median(entry, name, clients, 'tok_s'):.0f}"
                    for name in PEERS
                    if level_median(entry, name, clients, "tok_s")
                )
                cells.append(f"{clients} clients {speeds} → {best}")
            out.append(f"- {model} {workload} (call {entry['call']}): {'; '.join(cells)}")
    return out


def baseline_drift(report: dict[str, Any], model: str, call: int) -> float | None:
    """Half the range of one call's baseline readings over their median: how far the machine
    moved one cell within the call; None with fewer than two readings."""
    values = [r["tok_s"] for r in report.get("baseline", {}).get(model, []) if r["call"] == call]
    if len(values) < 2:
        return None
    return float((max(values) - min(values)) / 2 / statistics.median(values))


def _when(before: str) -> str:
    return "at the end" if before == "end" else f"before {before}"


def baseline_lines(report: dict[str, Any]) -> list[str]:
    name, workload, clients = BASELINE
    out = []
    for model, rows in report.get("baseline", {}).items():
        for call in sorted({r["call"] for r in rows}):
            mine = [r for r in rows if r["call"] == call]
            reads = ", ".join(f"{r['tok_s']:.0f} ({_when(r['before'])})" for r in mine)
            drift = baseline_drift(report, model, call)
            share = "one reading" if drift is None else f"±{drift:.1%} of its median"
            out.append(
                f"- {model}, call {call}: {name} {workload} at {clients} clients read {reads} "
                f"tok/s: {share}"
            )
    return out or ["- no baseline readings"]


def _excerpt(text: str, chars: int = 48) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return f"`{flat[:chars]}`" if flat else "(empty)"


def sample_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per workload and server: how many of the unseeded texts differ, whether one seed
    repeated its text, and the first text's start (the texts themselves are in the JSON)."""
    out = [
        "| model | workload | server | distinct texts, no seed | seed 7 twice: same text "
        "| first text (start) |",
        "|---|---|---|---:|---|---|",
    ]
    for model, by_workload in runs.items():
        for workload, entry in by_workload.items():
            for server, texts in (entry.get("samples") or {}).items():
                if any("error" in t for t in texts):
                    error = next(t["error"] for t in texts if "error" in t)
                    out.append(f"| {model} | {workload} | {server} | – | – | {error} |")
                    continue
                free = [t["text"] for t in texts if t["seed"] is None]
                seeded = [t["text"] for t in texts if t["seed"] is not None]
                same = "yes" if len(set(seeded)) == 1 else "no"
                out.append(
                    f"| {model} | {workload} | {server} | {len(set(free))} of {len(free)} "
                    f"| {same if seeded else '–'} | {_excerpt(free[0] if free else '')} |"
                )
    return out


class Goals:
    """Goal lines, each met or missed with its ratio, and their tally. A ratio nearer its bound
    than the call's baseline drift is marked so: the machine alone moves a cell that much."""

    def __init__(self) -> None:
        self.outcomes: list[bool] = []
        self.drift: float | None = None

    def judge(self, ratio: float, bound: float, at_least: bool) -> str:
        ok = ratio >= bound if at_least else ratio <= bound
        self.outcomes.append(ok)
        sign = ">=" if at_least else "<="
        close = self.drift is not None and abs(ratio / bound - 1) <= self.drift
        note = f", within the baseline's ±{self.drift:.0%}" if close and self.drift else ""
        return f"{ratio:.2f}x (goal {sign} {bound}x: {'met' if ok else 'missed'}{note})"

    def tally(self) -> str:
        return f"{sum(self.outcomes)} of {len(self.outcomes)} goals met"


def rate_line(goals: Goals, runs: dict[str, Any], workload: str, clients: int) -> str:
    """A sampling workload's tok/s against Ember's own greedy and against the peer at its best."""
    entry = runs[workload]
    peer = best_peer(entry, clients)
    greedy = runs.get(workload.partition("/")[0] + "/greedy")
    ours = level_median(entry, EMBER, clients, "tok_s")
    own = level_median(greedy, EMBER, clients, "tok_s")
    if not ours:
        return f"{workload}, {clients} clients: Ember's tok/s not measured"
    vs_own = (
        f"vs Ember's greedy {own:.0f}: {goals.judge(ours / own, 0.9, True)}"
        if own
        else "Ember's greedy not measured"
    )
    if peer is None:
        return f"{workload}, {clients} clients: tok/s {ours:.0f}; {vs_own}; no peer measured"
    theirs = level_median(entry, peer, clients, "tok_s")
    vs_peer = f"vs {peer} {theirs:.0f}: {goals.judge(ours / theirs, 1.5, True)}"
    return f"{workload}, {clients} clients: tok/s {ours:.0f}; {vs_own}; {vs_peer}"


def ttft_line(goals: Goals, entry: dict[str, Any], workload: str, clients: int) -> str:
    """Ember's TTFT p99 against that of the peer at its best (the faster configuration)."""
    peer = best_peer(entry, clients)
    ours = level_median(entry, EMBER, clients, "ttft_p99")
    theirs = level_median(entry, peer, clients, "ttft_p99") if peer else 0.0
    if not ours or not theirs:
        return f"{workload}, {clients} clients: TTFT p99 not measured for both servers"
    return (
        f"{workload}, {clients} clients: TTFT p99 {ours * 1e3:.0f} vs {theirs * 1e3:.0f} ms "
        f"({peer}) = {goals.judge(ours / theirs, 1.0, False)}"
    )


def greedy_info(entry: dict[str, Any], workload: str, clients: int) -> str:
    peer = best_peer(entry, clients)
    ours = level_median(entry, EMBER, clients, "tok_s")
    theirs = level_median(entry, peer, clients, "tok_s") if peer else 0.0
    if not ours or not theirs:
        return f"{workload}, {clients} clients: not measured for both servers"
    return (
        f"{workload}, {clients} clients (information): tok/s {ours:.0f} vs {theirs:.0f} "
        f"({peer}) = {ours / theirs:.2f}x"
    )


def verdict(report: dict[str, Any], runs: dict[str, Any], model: str) -> list[str]:
    """Issue 33's goals at every level, from the medians over the repeats, each against the
    peer at its best at that level: a sampling workload's tok/s >= 0.9x Ember's own greedy and
    >= 1.5x the peer's, TTFT p99 <= the peer's in every workload; greedy tok/s for information."""
    goals, lines = Goals(), []
    for clients in LEVELS:
        for workload, entry in runs.items():
            goals.drift = baseline_drift(report, model, entry["call"])
            if is_greedy(workload):
                lines.append(greedy_info(entry, workload, clients))
            else:
                lines.append(rate_line(goals, runs, workload, clients))
            lines.append(ttft_line(goals, entry, workload, clients))
    return [f"- {model}, {line}" for line in lines] + ["", f"{model}: {goals.tally()}."]


def ordered(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each model's workloads in `WORKLOADS`' order, others after: merged calls keep theirs."""

    def rank(workload: str) -> int:
        return WORKLOADS.index(workload) if workload in WORKLOADS else len(WORKLOADS)

    return {m: dict(sorted(w.items(), key=lambda kv: rank(kv[0]))) for m, w in runs.items()}


def call_lines(calls: list[dict[str, Any]]) -> list[str]:
    out = []
    for c in calls:
        name = f" {c['name']}," if c.get("name") else ""
        out.append(
            f"- call {c['call']} ({c['started']},{name} {c['gpu']}, llama-cpp-python "
            f"{c['llama_cpp_python']}): workloads {', '.join(c['workloads']) or 'none'} on "
            f"{', '.join(c['models'])}; `gpu_bench.py {' '.join(c['argv'])}`; skipped: "
            f"{'; '.join(c['skipped']) or 'nothing'}"
        )
    return out


def thermal_lines(th: dict[str, Any]) -> list[str]:
    return [
        "",
        f"## Thermal governor on real NVML readings (call {th.get('call', '?')})",
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


def markdown(report: dict[str, Any]) -> str:
    runs = ordered(report["runs"])
    seconds = sorted({float(r["seconds"]) for e in _entries(runs) for r in e["rows"]})
    out = [
        f"# GPU benchmark: Ember vs llama-server at its best on {report['gpu']} (issues 33, 46)",
        "",
        f"llama.cpp from llama-cpp-python {report['llama_cpp_python']}'s sources, CUDA sm_90, "
        "one build for every server. Random-weight GGUFs in real shapes (`bench/gpu_models.py`); "
        f"~62-token distinct prompts, {MAX_TOKENS} tokens out, the same request body to every "
        f"server; {CTX_PER_SEQ} tokens of context per slot; slots = {max(LEVELS)}. Each level "
        f"runs {'/'.join(f'{s:g}' for s in seconds) or '?'} s: every client sends "
        "requests back to back until then, the requests in flight finish and count, and tok/s "
        "is the tokens (from each stream's usage) over the wall from the common start to the "
        "last request's end. Every workload of a call is measured in that call, the servers "
        "taking turns level by level, the order rotating; every figure is the median (min–max) "
        "over the repeats, errors summed, NVML the mean of the repeats' means (°C: the "
        f"highest). The load generator's clients are dealt over {CLIENT_PROCS} processes, the "
        "same for every server; each client opens its connection with a throw-away "
        "`GET /v1/models` before the clock starts.",
        "",
        *table(runs),
        "",
        "What each server sampled with (tokens counted from each stream's usage):",
        "",
        *sampled_with(runs),
        "",
        "The peer at its best: both llama-server configurations ran every level (tok/s, plain "
        "vs `--backend-sampling`); each level's verdict takes the faster:",
        "",
        *peer_lines(runs),
        "",
        f"llama-server flags: `{' '.join(report['llama_server_flags'])}`.",
        "",
        "The baseline, repeated through the call (a ratio nearer its goal than this drift is "
        "marked in the goals below):",
        "",
        *baseline_lines(report),
        "",
        "Output texts (the same prompt per workload; no seed three times as the benchmark's "
        "requests, then `seed` 7 twice; every text and seed in the JSON's `samples`):",
        "",
        *sample_lines(runs),
        "",
        "## Goals (issue 33): medians over the repeats, against the peer at its best per level",
        "",
        *verdict(report, runs.get("llama-8b", {}), "llama-8b"),
    ]
    for model in (m for m in runs if m != "llama-8b"):
        out += ["", f"{model} (not a goal):", "", *verdict(report, runs[model], model)]
    if report.get("thermal"):
        out += thermal_lines(report["thermal"])
    out += ["", "## Calls (the `call` column of the table)", "", *call_lines(report["calls"])]
    if report.get("diagnose"):
        call = report["diagnose"].get("call", "?")
        out += ["", f"## `python -m ember_runtime.prewarm diagnose` (call {call})", "", "```"]
        out += [report["diagnose"]["table"].rstrip(), "```"]
    return "\n".join(out) + "\n"


def _entries(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for by_workload in runs.values() for entry in by_workload.values()]


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = ordered(report["runs"])
    if runs:
        cols = max(len(w) for w in runs.values())
        fig, axes = plt.subplots(
            len(runs), cols, figsize=(5 * cols, 4 * len(runs)), squeeze=False, sharey="row"
        )
        for row, (model, by_workload) in enumerate(runs.items()):
            for col, (workload, entry) in enumerate(by_workload.items()):
                plot_workload(axes[row][col], f"{model} {workload}", entry)
        fig.suptitle("output tok/s: median over the repeats, bars min–max")
        fig.tight_layout()
        fig.savefig(out / "gpu_bench.png", dpi=90)
    if report.get("thermal"):
        plot_thermal(report["thermal"], out)


def plot_workload(ax: Any, title: str, entry: dict[str, Any]) -> None:
    by_server: dict[str, list[tuple[int, list[float]]]] = {}
    for (server, clients), rows in groups(entry["rows"]).items():
        by_server.setdefault(server, []).append((clients, [r["tok_s"] for r in rows]))
    for server, points in by_server.items():
        x = [c for c, _ in points]
        mid = [statistics.median(v) for _, v in points]
        low = [m - min(v) for m, (_, v) in zip(mid, points, strict=True)]
        high = [max(v) - m for m, (_, v) in zip(mid, points, strict=True)]
        ax.errorbar(x, mid, yerr=[low, high], marker="o", capsize=4, label=server)
    ax.set_title(f"{title} (call {entry['call']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(LEVELS), [str(c) for c in LEVELS])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tok/s")
    ax.grid(alpha=0.3)
    ax.legend()


def plot_thermal(th: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

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


def keep_previous(report: dict[str, Any], old: dict[str, Any]) -> int:
    """Carry an earlier call's results into this call's report: its calls, every (model,
    workload) entry (each says which call measured it; this call's own replace them as they
    are measured), its baseline readings (this call's are added), its thermal run and
    diagnosis (replaced if this call runs them). Returns this call's number."""
    if "calls" not in old:
        raise SystemExit("--previous: not a results file of this gpu_bench.py (no 'calls')")
    report["calls"] = [*old["calls"], *report["calls"]]
    for model, by_workload in old.get("runs", {}).items():
        report["runs"].setdefault(model, {}).update(by_workload)
    for model, rows in old.get("baseline", {}).items():
        report.setdefault("baseline", {}).setdefault(model, []).extend(rows)
    for key in ("thermal", "diagnose", "metrics_sample"):
        if key in old:
            report[key] = old[key]
    return len(old["calls"]) + 1


def new_report(args: argparse.Namespace, nvml: NvmlLog, workloads: list[str]) -> dict[str, Any]:
    import llama_cpp

    record = {
        "call": 1,
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "name": args.run_name,
        "argv": sys.argv[1:],
        "workloads": workloads,
        "models": args.only.split(","),
        "gpu": nvml.name,
        "llama_cpp_python": llama_cpp.__version__,
        "idle": asdict(nvml.read()),
        "skipped": [],
        "load_seconds": {},
    }
    return {
        "gpu": nvml.name,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_server_flags": llama_server_flags(max(LEVELS)),
        "calls": [record],
        "runs": {},
    }


def thermal_step(call: Call, model: Path) -> None:
    if call.args.skip_thermal:
        return
    if not call.fits(THERMAL_SECONDS + 40):
        call.skip("thermal run")
        return
    print("thermal governor run", flush=True)
    thermal = thermal_run(model, max(LEVELS), call.args.out / "work", call.nvml, call.args.margin)
    call.report["thermal"] = thermal | {"call": call.index}
    call.save()


def diagnose_step(call: Call, model: Path) -> None:
    if call.args.skip_diagnose:
        return
    if not call.fits(DIAGNOSE_SECONDS):
        call.skip("prewarm diagnose")
        return
    report = diagnose(model, call.args.out / "work", call.left() - 5)
    call.report["diagnose"] = report | {"call": call.index}
    call.save()


def run_call(call: Call, workloads: list[str]) -> None:
    """The comparison first, then in what time is left the thermal run and the diagnosis."""
    args = call.args
    models = {name: write_model(name, args.models) for name in args.only.split(",")}
    for index, (name, model) in enumerate(models.items()):
        print(f"{name}: ~{plan_seconds(args, workloads):.0f} s of levels", flush=True)
        bench_model(call, name, model, workloads)
        if index == 0:
            thermal_step(call, model)
    diagnose_step(call, list(models.values())[-1])  # the smallest, with every model


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start")
    ap.add_argument("--only", default="llama-8b", help="models (gpu_models.py names)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list; '' for none")
    ap.add_argument("--reps", type=int, default=1, help="repeats of every level")
    ap.add_argument("--level-seconds", type=float, default=10.0, help="duration of a level")
    ap.add_argument(
        "--backend-sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run llama-server --backend-sampling too: the peer at its best per level",
    )
    ap.add_argument("--spec-peer", action="store_true", help=f"also {PEER_SPEC}")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="clients per level")
    ap.add_argument("--skip-thermal", action="store_true", help="no thermal governor run")
    ap.add_argument("--skip-diagnose", action="store_true", help="no prewarm diagnose")
    ap.add_argument("--thermal-margin", dest="margin", type=float, default=4.0)
    ap.add_argument("--previous", type=Path, help="keep the workloads not run here from here")
    ap.add_argument("--run-name", default="", help="a label for this call in the results")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    global LEVELS  # noqa: PLW0603 -- one call's levels: every table and plot reads them
    LEVELS = tuple(int(c) for c in args.levels.split(","))
    workloads = [w if "/" in w else f"{w}/greedy" for w in args.workloads.split(",") if w]
    for workload in workloads:
        shape, _, mode = workload.partition("/")
        if shape not in SHAPES or mode not in SAMPLING:
            raise SystemExit(f"--workloads: {workload!r} is not shape/sampling of runtime_bench")
    stop_at = time.monotonic() + args.deadline
    (args.out / "work").mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    nvml = NvmlLog().start()
    report = new_report(args, nvml, workloads)
    index = 1
    if args.previous is not None:
        index = keep_previous(report, json.loads(args.previous.read_text()))
    call = Call(args, report, nvml, stop_at, index=index, record=report["calls"][-1])
    call.record["call"] = index
    try:
        run_call(call, workloads)
    finally:
        nvml.stop()
        call.save()
        plot(report, args.out)
    print(markdown(report), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
