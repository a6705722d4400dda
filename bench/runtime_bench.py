"""Ember's runtime against llama.cpp's `llama-server` at its best: same run, interleaved, repeated.

Same model (Gemma 3 270M Q4_K_M), same threads (2), same request bodies, same per-sequence
context (512 tokens). The servers (`--servers`): Ember (default), and the peer in two
configurations, `llama-server -np 16` with its context and KV layout pinned (`-c 8192 -kvu
--swa-full`: a unified 8192-cell pool, i.e. 512 per slot) and its host-RAM prompt cache at its
default (8 GiB) or off (`--cache-ram 0`). Each goal is judged against whichever peer
configuration is better *for that goal* at that row (tok/s: the faster; TTFT: the quicker):
the peer at its best. Also available: `ember-deterministic`, `ember-unified`, `llama_cpp.server`
and `ember:key=value+...` engine variants.

One server is under load at a time, never two side by side, but all are started first and the
run goes level by level: each level runs every server in turn, the order rotating from level
to level, and the whole pass is repeated (`--repeats`, 3 by default). This machine's speed
drifts by more than the goals' margins within minutes (raw decode 58.5-70.7 tok/s in one half
hour, no steal): a ratio is taken within one repeat and the goal judged on the median of those
paired ratios, with their range beside it (`bench/paired.py`). Each repeat takes the machine's
benchmark lock (`--lock`, `flock /tmp/ember-cpu.lock`) for itself, so other work may run
between repeats and none during one. Idle servers hold memory, not CPU. The single-stream
ceiling, raw `llama_decode`, is measured right before and right after Ember's one-client level
of each repeat and the mean is that repeat's reference.

The load generator (one asyncio process, httpx + SSE, no per-token parsing beyond json.loads)
shares the cores with the server under test and is the same for every server. Levels of 1, 4,
8 and 16 concurrent streaming clients; at least 24 requests per level, and 3 per client. Two
prompt shapes, each with the sampling modes users send (greedy; temperature 0.8 + top_p 0.95;
no sampling field at all):

* (a) `distinct`: completions of distinct ~64-token prompts (no shared prefix), 64 tokens out;
* (b) `shared-chat`: chat completions with one shared ~300-token system prompt and short user
  turns, 32 tokens out (what a prefix cache is for).

Reported per server, workload and level: output tok/s, TTFT p50/p99, ITL p50/p99, errors; per
server the peak RSS (VmHWM of the server process); raw single-stream `llama_decode` speed (no
server) as the ceiling for one stream; a PNG with the curves.

The first wave, and why every wave is a burst. All clients send their first request at the same
instant, so the first wave is a burst of `clients` prompts onto an idle server; its slowest
first token is reported beside the TTFT percentiles. Ember admits every waiting prompt into the
next step (up to 1,024 prompt tokens, `engines/scheduler.py`), so a burst of 16 ~64-token
prompts is one `llama_decode`, and every first token of the burst comes at its end: on a CPU
where a step costs about the sum of its rows (this AVX2 machine kind: ~2.5 ms per prompt
token, 256 of them in one call 0.55 s against 0.15-0.19 s for 64), the slowest first token is
the whole burst's prompt work however it is cut, for any server. The later waves are bursts
too: every request has the same length, so the clients stay in step, finish in the same step
and come back together, and TTFT p50 is close to p99. A step log of Ember at 4 clients (not
committed) showed a wave's first returning request get a step of its own (in the wave logged
with arrival times it came 61-67 ms before the others, whose requests had finished one step
later), the other three sharing the next: about the same work as one step of all four, so
holding the first back would cost it more than it saves the others.

    .venv/bin/python bench/runtime_bench.py [--threads 2] [--clients 1,4,8,16] [--requests 24]
        [--repeats 3] [--servers ember,llama-server,llama-server-cr0] [--replot JSON]

Writes `bench/results/runtime_bench.{md,json,png}` (58 min on a 2-core Intel Xeon VM, with the
defaults above).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import steal_seconds
from bench.paired import median, paired_ratios, spread
from images.llama_build import ensure_llama_server
from tests.support.net import free_port

RESULTS = Path(__file__).resolve().parent / "results"
CTX_PER_SEQ = 512
SLOTS = 16  # Ember maxBatchSize = llama-server -np
_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint landscapes in the mountains",
    "two rival bakers in a small northern town",
    "an astronaut repairing a satellite during a solar storm",
    "a detective solving a mystery on an overnight train",
    "a child who discovers a hidden garden behind the school",
    "a musician crossing the desert with a broken violin",
    "a cartographer mapping an island that keeps changing",
]
_STYLES = [
    "Use simple words and short sentences.",
    "Write it for children, in a warm voice.",
    "Make it funny, with a surprising ending.",
    "Tell it in the first person, as a diary.",
    "Keep a calm, slow pace, full of details.",
    "Write it as an old legend told by a fire.",
]
# Workload (a): 48 distinct prompts of ~64 tokens; each starts with its own topic, so no two
# share a prefix worth reusing.
PROMPTS = [
    (
        f"{topic.capitalize()}: that is the subject of a long, detailed story. {style} Describe "
        "the setting, the weather, the sounds and the smells, introduce every character with "
        "care, and do not stop early. The story begins like this: It was"
    )
    for style in _STYLES
    for topic in _TOPICS
]
# Workload (b): one ~300-token system prompt shared by every request, short user turns.
SYSTEM = (
    "You are the assistant of a small maintenance team that looks after a fleet of edge "
    "devices in remote sites: weather stations, water pumps, solar inverters and cameras. "
    "Always answer in plain English, in at most three short sentences, without markdown. "
    "When a device is mentioned, first say which site it belongs to if you know it, then "
    "what the most likely cause of the problem is, then the single next step a technician "
    "should take. Never invent serial numbers, prices or dates. If the question is not about "
    "the fleet, say politely that you only help with the fleet. The sites are: North Ridge "
    "(three weather stations, one camera, a solar inverter), Lake Farm (two water pumps, a "
    "solar inverter, four soil sensors), Old Mill (a camera, a gateway and a battery bank), "
    "Harbour (two cameras, a tide gauge, a gateway) and Quarry Road (a weather station, a "
    "water pump and a gateway). Gateways forward data every five minutes over LTE; a gateway "
    "that misses three reports in a row is considered offline. Batteries should stay between "
    "twenty and ninety percent; pumps report their flow every minute; cameras upload a frame "
    "every ten minutes. Firmware updates happen on Tuesdays at night and may restart a "
    "device. Technicians visit North Ridge and Lake Farm on Mondays, the others on Thursdays. "
    "Escalate to the on-call engineer only when a whole site is offline for more than an hour."
)
QUESTIONS = [
    f"The {device} at {site} {problem}. What should we do?"
    for device, site in [
        ("gateway", "Old Mill"),
        ("water pump", "Lake Farm"),
        ("camera", "Harbour"),
        ("weather station", "North Ridge"),
        ("solar inverter", "Lake Farm"),
        ("tide gauge", "Harbour"),
        ("battery bank", "Old Mill"),
        ("water pump", "Quarry Road"),
    ]
    for problem in [
        "stopped reporting",
        "reports strange values",
        "restarted twice today",
        "is slow",
        "shows an error light",
        "lost its connection",
    ]
]
SHAPES = {"distinct": 64, "shared-chat": 32}  # prompt shape -> max_tokens
# What a request asks of the sampler (the same body to every server). `client-defaults` sends no
# sampling field at all: each server then samples with its own defaults (SAMPLED_WITH).
SAMPLING: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "client-defaults": {},
}
SAMPLED_WITH = {
    "ember": {
        "greedy": "temperature 0 (argmax)",
        "sampled": "temperature 0.8, top_p 0.95 (no top_k: OpenAI's defaults otherwise)",
        "client-defaults": "OpenAI's defaults: temperature 1, nothing filtered (full softmax)",
    },
    "llama-server": {
        "greedy": "temperature 0 (argmax)",
        "sampled": "temperature 0.8, top_p 0.95, and its own top_k 40, min_p 0.05",
        "client-defaults": "its own defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8",
    },
}
# A workload is a prompt shape and a sampling mode: "distinct/sampled".
WORKLOADS = [
    "distinct/greedy",
    "distinct/sampled",
    "distinct/client-defaults",
    "shared-chat/greedy",
]


def max_tokens_of(workload: str) -> int:
    return SHAPES[workload.partition("/")[0]]


@dataclass
class RequestStats:
    ttft: float
    gaps: list[float]
    tokens: int
    turn: int = 0  # the request's place in its client's sequence; 0: the first wave


@dataclass
class LevelResult:
    server: str
    workload: str
    clients: int
    requests: int
    tokens: int
    wall: float
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    errors: int = 0
    first_error: str = ""  # what the first failed request said, to tell a server's fault apart
    # The first wave: every client's first request, all sent at the same instant (a burst of
    # `clients` prompts onto an idle server). Its slowest first token, in seconds.
    first_wave_ttft: float = 0.0
    repeat: int = 0  # which pass over every (workload, level, server) this row came from


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    # A GET path that answers 200 once the server is ready (an embedding server serves no
    # completions); empty: a two-token completion is the probe.
    health: str = ""
    proc: subprocess.Popen[bytes] | None = None
    peak_rss_bytes: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> None:
        log = (log_dir / f"{self.name}.log").open("wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {log.name}")
            try:
                if self.health:
                    r = httpx.get(self.base + self.health, timeout=30)
                else:
                    r = httpx.post(
                        self.base + "/v1/completions",
                        json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                        timeout=30,
                    )
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready")

    def peak_rss(self) -> int:
        """VmHWM: the most resident memory the server process has held since it started."""
        if self.proc is None:
            return 0
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc is None:
            return
        self.peak_rss_bytes = self.peak_rss()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def request_body(
    workload: str, index: int, max_tokens: int, level: int | str = 0
) -> tuple[str, dict[str, object]]:
    """(path, body) of request `index` of a workload ("shape/sampling"; a bare shape is
    greedy): streaming, with usage, the same body to every server.

    Each request carries a serial (sampling mode.`level`.`index`) near its start: no prompt repeats
    within a server's run: a server with a prompt cache that outlives its requests (llama-server's
    `--cache-ram`) would otherwise serve the later levels' "distinct" prompts from the cache
    of the earlier levels, and the prefix shared in (b) would be the whole prompt.
    """
    shape, _, mode = workload.partition("/")
    common = {
        "max_tokens": max_tokens,
        **SAMPLING[mode or "greedy"],
        "stream": True,
        "stream_options": {"include_usage": True},  # tokens counted by the server's own usage
    }
    # The sampling mode is part of the serial: a server's prompt cache that outlives requests
    # (llama-server's --cache-ram) would otherwise serve a sampled level's prompts from the
    # greedy level before it (seen: TTFT 0.11 s against 0.66 s for the same prompts uncached).
    serial = f"{list(SAMPLING).index(mode or 'greedy')}.{level}.{index}"
    if shape == "distinct":
        prompt = f"Story {serial}. {PROMPTS[index % len(PROMPTS)]}"
        return "/v1/completions", {"prompt": prompt, **common}
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Ticket {serial}. {QUESTIONS[index % len(QUESTIONS)]}"},
    ]
    return "/v1/chat/completions", {"messages": messages, **common}


def chunk_text(chunk: dict[str, object]) -> str:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return ""
    choice = choices[0]
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return text if isinstance(text, str) else ""


def cpu_model() -> str:
    """The CPU's model name: figures from one machine kind do not carry to another."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


async def _send(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> httpx.Response:
    """POST, streaming; sent again once if the server had closed the kept-alive connection
    before answering. llama-server's HTTP library closes an idle or often-used one (at 1 client
    it lost 14 of 48 requests that way); clients resend such a request (the OpenAI SDK does)."""
    request = client.build_request("POST", path, json=body)
    try:
        return await client.send(request, stream=True)
    except httpx.RemoteProtocolError:  # "Server disconnected without sending a response"
        return await client.send(client.build_request("POST", path, json=body), stream=True)


async def one_request(
    client: httpx.AsyncClient, path: str, body: dict[str, object]
) -> RequestStats:
    began = time.perf_counter()  # a resent request's lost time stays in its TTFT
    last: float | None = None
    ttft = 0.0
    gaps: list[float] = []
    tokens = 0
    usage: int | None = None
    response = await _send(client, path, body)
    try:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"].get("completion_tokens")
            if not chunk_text(chunk):
                continue
            now = time.perf_counter()
            if last is None:
                ttft = now - began
            else:
                gaps.append(now - last)
            last = now
            tokens += 1
    finally:
        await response.aclose()
    # The usage's count where the server sends one (a token whose text is half a UTF-8
    # character makes no chunk of its own), else the text chunks.
    return RequestStats(ttft, gaps, usage if isinstance(usage, int) else tokens)


async def _open_connections(client: httpx.AsyncClient, count: int) -> None:
    """A throw-away request per client before the clock starts. A fresh process's first request
    pays for the connect and httpx's lazy set-up: on the GPU machine the first request of a
    level took 110-170 ms against a TTFT p50 of 17 ms, for either server alike, in a second
    round as in the first (issue 17), and at 8 clients those first requests were the p99."""
    await asyncio.gather(*(client.get("/v1/models") for _ in range(count)))


async def run_clients(
    base: str,
    workload: str,
    clients: int,
    indices: list[int],
    *,
    more: Callable[[int], bool],
    serial: int | str,
    start_at: float | None = None,
) -> tuple[list[RequestStats], list[str], float]:
    """Clients `indices` (of `clients` in the level), each sending requests one after another
    while `more(turn)` holds, from `start_at` (wall clock; connections are opened before it);
    `serial` goes into every prompt (`request_body`). Returns their stats, what the failed
    ones said, and when the last request ended (wall clock)."""
    stats: list[RequestStats] = []
    failures: list[str] = []
    max_tokens = max_tokens_of(workload)
    last_end = time.time()
    limits = httpx.Limits(max_connections=len(indices) + 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await _open_connections(client, len(indices))
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))

        async def worker(index: int) -> None:
            nonlocal last_end
            turn = 0
            while more(turn):
                path, body = request_body(workload, index + turn * clients, max_tokens, serial)
                try:
                    stat = await one_request(client, path, body)
                    stat.turn = turn
                    stats.append(stat)
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])
                    await asyncio.sleep(0.1)  # a server that refuses is not hammered
                last_end = max(last_end, time.time())
                turn += 1

        await asyncio.gather(*(worker(i) for i in indices))
    return stats, failures, last_end


def _client_process(
    args: tuple[str, str, int, list[int], int, float],
) -> tuple[list[RequestStats], list[str]]:
    base, workload, clients, indices, per_client, start_at = args
    # Every process's clients start together, at start_at.
    stats, failures, _end = asyncio.run(
        run_clients(
            base,
            workload,
            clients,
            indices,
            more=lambda turn: turn < per_client,
            serial=clients,
            start_at=start_at,
        )
    )
    return stats, failures


def _level_result(
    server: Server,
    workload: str,
    clients: int,
    wall: float,
    outcome: tuple[list[RequestStats], list[str]],
) -> LevelResult:
    stats, failures = outcome
    tokens = sum(s.tokens for s in stats)
    ttfts = [s.ttft for s in stats]
    gaps = [g for s in stats for g in s.gaps]
    first_wave = [s.ttft for s in stats if s.turn == 0]
    return LevelResult(
        server=server.name,
        workload=workload,
        clients=clients,
        requests=len(stats),
        tokens=tokens,
        wall=wall,
        tok_s=tokens / wall,
        ttft_p50=pct(ttfts, 0.5),
        ttft_p99=pct(ttfts, 0.99),
        itl_p50=pct(gaps, 0.5),
        itl_p99=pct(gaps, 0.99),
        errors=len(failures),
        first_error=failures[0] if failures else "",
        first_wave_ttft=max(first_wave, default=0.0),
    )


async def run_level(
    server: Server, workload: str, clients: int, requests: int, repeat: int = 0
) -> LevelResult:
    """`requests` requests (rounded up to a multiple of `clients`), `clients` at a time, from
    this process's event loop. The repeat is part of every prompt's serial: a prompt cache that
    outlives requests must not serve a repeat from the one before."""
    per_client = -(-requests // clients)
    start_at = time.time() + 0.5  # after the connections are open
    stats, failures, _end = await run_clients(
        server.base,
        workload,
        clients,
        list(range(clients)),
        more=lambda turn: turn < per_client,
        serial=f"{repeat}.{clients}" if repeat else clients,
        start_at=start_at,
    )
    wall = time.time() - start_at
    result = _level_result(server, workload, clients, wall, (stats, failures))
    result.repeat = repeat
    return result


def run_level_procs(
    server: Server, workload: str, clients: int, requests: int, procs: int
) -> LevelResult:
    """As `run_level`, with the clients dealt over `procs` forked processes (where cores are
    spare): one Python event loop parsing thousands of SSE events a second falls behind, and
    its lag is counted as the server's TTFT and ITL (issue 17: a 64-client level's second
    wave, sent while one loop parsed a faster server's stream, read 0.79 s of TTFT that 8
    processes measured as 0.46 s)."""
    import multiprocessing

    per_client = -(-requests // clients)
    procs = max(1, min(procs, clients))
    start_at = time.time() + 1.0  # after the forks and their connections: all start together
    jobs = [
        (server.base, workload, clients, list(range(clients))[p::procs], per_client, start_at)
        for p in range(procs)
    ]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_client_process, jobs)
        wall = time.time() - start_at
    stats = [s for part, _ in parts for s in part]
    failures = [f for _, part in parts for f in part]
    return _level_result(server, workload, clients, wall, (stats, failures))


def raw_decode_speed(model: Path, threads: int, tokens: int, repack: bool) -> float:
    """Single-stream decode tok/s straight through llama_decode: the ceiling for one stream."""
    code = f"""
import ctypes, time, numpy as np, llama_cpp as ll
CB = ll.llama_log_callback(lambda *a: None)  # keep a reference: C calls it later
ll.llama_log_set(CB, ctypes.c_void_p(0))
ll.llama_backend_init()
mp = ll.llama_model_default_params(); mp.load_mode = ll.LLAMA_LOAD_MODE_MMAP
mp.use_extra_bufts = {repack}
m = ll.llama_model_load_from_file({str(model)!r}.encode(), mp)
cp = ll.llama_context_default_params(); cp.n_ctx = {CTX_PER_SEQ}; cp.n_batch = 512
cp.n_ubatch = 512; cp.n_threads = {threads}; cp.n_threads_batch = {threads}; cp.no_perf = True
ctx = ll.llama_init_from_model(m, cp); vocab = ll.llama_model_get_vocab(m)
nv = ll.llama_vocab_n_tokens(vocab)
text = {PROMPTS[0]!r}.encode(); buf = (ctypes.c_int32 * 512)()
n = ll.llama_tokenize(vocab, text, len(text), buf, 512, True, True)
b = ll.llama_batch_init(512, 0, 1)
def run(toks, start, want_last):
    for i, t in enumerate(toks):
        b.token[i] = t; b.pos[i] = start + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0
        b.logits[i] = want_last and i == len(toks) - 1
    b.n_tokens = len(toks); assert ll.llama_decode(ctx, b) == 0
    row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, len(toks) - 1), (nv,))
    return int(row.argmax())
best = 0.0
for _ in range(3):
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    tok = run(list(buf[:n]), 0, True)
    t0 = time.perf_counter()
    for i in range({tokens}):
        tok = run([tok], n + i, True)
    best = max(best, {tokens} / (time.perf_counter() - t0))
print(best)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def ember_config(model: Path, engine: dict[str, object]) -> Path:
    """A RuntimeConfig file (the CLI has no flags for these engine settings)."""
    name = "-".join(f"{k}{v}" for k, v in engine.items() if v) or "default"
    path = RESULTS / f"ember-bench-config-{name}.yaml"
    config = {"modelName": model.stem, "modelDir": str(model.parent), "engine": engine}
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def ember(name: str, model: Path, threads: int, **engine: object) -> Server:
    port = free_port()
    config = ember_config(model, engine)
    argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(config)]
    argv += ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--threads", str(threads), "--max-batch-size", str(SLOTS)]
    argv += ["--context-length", str(CTX_PER_SEQ), "--max-queue", "256", "--log-level", "warning"]
    return Server(name, argv, port)


def llama_server(model: Path, threads: int, cache_ram: int | None = None) -> Server:
    """llama-server as Ember runs: 16 slots of 512 cells in one pool (`-kvu`), the full-size
    sliding-window cache Ember's context has (`--swa-full`, llama.cpp's context default; the
    server's own default is off). Its host-RAM prompt cache at its default (8 GiB) or `cache_ram`
    MiB: the bench runs both and each table row says which (the peer at its best)."""
    port = free_port()
    t = str(threads)
    argv = [
        str(ensure_llama_server()),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    argv += ["-t", t, "-tb", t, "-np", str(SLOTS), "-c", str(CTX_PER_SEQ * SLOTS), "-kvu"]
    argv += ["--swa-full", "--log-disable"]
    name = f"llama-server -np {SLOTS}"
    if cache_ram is not None:
        argv += ["--cache-ram", str(cache_ram)]
        name += f" --cache-ram {cache_ram}"
    return Server(name, argv, port)


def llama_cpp_server(model: Path, threads: int) -> Server:
    port = free_port()
    t = str(threads)
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", t]
    argv += ["--n_threads_batch", t, "--n_ctx", str(CTX_PER_SEQ)]
    argv += ["--interrupt_requests", "False", "--verbose", "False"]
    return Server("llama_cpp.server", argv, port)


def servers(model: Path, threads: int, which: list[str]) -> list[Server]:
    makers = {
        "ember": lambda: ember("ember", model, threads),
        # Not in the default set: the candidate KV layout for the default (engines/llamacpp).
        "ember-unified": lambda: ember("ember (unified KV)", model, threads, kvUnified=True),
        "ember-deterministic": lambda: ember(
            "ember (deterministic)", model, threads, deterministic=True
        ),
        "llama-server": lambda: llama_server(model, threads),
        "llama-server-cr0": lambda: llama_server(model, threads, cache_ram=0),
        "llama_cpp.server": lambda: llama_cpp_server(model, threads),
    }
    return [
        makers[name]() if name in makers else _ember_variant(name, model, threads) for name in which
    ]


def _ember_variant(name: str, model: Path, threads: int) -> Server:
    """`ember:key=value+...`: Ember with these engine settings (JSON values), for experiments,
    e.g. `ember:stepTokens=1024+kvUnified=true`."""
    if not name.startswith("ember:"):
        raise SystemExit(f"unknown server {name!r}")
    engine = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in name[6:].split("+"))}
    return ember(f"ember ({name[6:]})", model, threads, **engine)


Key = tuple[str, str, int]  # (server, workload, clients)


def by_key(results: list[LevelResult]) -> dict[Key, list[LevelResult]]:
    """The repeats of each (server, workload, level), in repeat order."""
    rows: dict[Key, list[LevelResult]] = {}
    for r in sorted(results, key=lambda r: r.repeat):
        rows.setdefault((r.server, r.workload, r.clients), []).append(r)
    return rows


def per_repeat(rows: list[LevelResult], attr: str) -> dict[int, float]:
    return {r.repeat: float(getattr(r, attr)) for r in rows}


def table(results: list[LevelResult], rss: dict[str, int]) -> str:
    """One row per (server, workload, level): median (min-max) over the repeats."""
    lines = [
        "| server | workload | clients | requests × repeats | tok/s | TTFT p50 (s) | TTFT p99 (s) "
        "| first wave: slowest TTFT (s) | ITL p50 (ms) | ITL p99 (ms) | errors | peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (server, workload, clients), rows in by_key(results).items():

        def cell(attr: str, fmt: str, scale: float = 1.0, rows: list[LevelResult] = rows) -> str:
            return spread([getattr(r, attr) * scale for r in rows], fmt)

        lines.append(
            f"| {server} | {workload} | {clients} | {rows[0].requests} × {len(rows)} "
            f"| {cell('tok_s', '{:.1f}')} | {cell('ttft_p50', '{:.3f}')} "
            f"| {cell('ttft_p99', '{:.3f}')} | {cell('first_wave_ttft', '{:.3f}')} "
            f"| {cell('itl_p50', '{:.1f}', 1e3)} | {cell('itl_p99', '{:.1f}', 1e3)} "
            f"| {sum(r.errors for r in rows)} | {rss.get(server, 0) / 2**20:.0f} |"
        )
    return "\n".join(lines)


def best_peer(
    rows: dict[Key, list[LevelResult]], workload: str, clients: int, attr: str, higher: bool
) -> str | None:
    """The llama-server configuration at its best for this metric at this workload and level
    (highest median tok/s, or lowest median TTFT): each goal is judged against the peer's best
    configuration for that goal, not one picked for another metric."""
    names = [
        key[0]
        for key in rows
        if key[0].startswith("llama-server") and key[1:] == (workload, clients)
    ]
    if not names:
        return None

    def score(name: str) -> float:
        value = median(list(per_repeat(rows[(name, workload, clients)], attr).values()))
        return value if higher else -value

    return max(names, key=score)


def ratio_note(
    rows: dict[Key, list[LevelResult]], workload: str, clients: int, attr: str, goal: str = ""
) -> str:
    """'attr: ours vs peer = paired ratio median (range) (goal: met|missed)'."""
    higher = attr == "tok_s"
    peer = best_peer(rows, workload, clients, attr, higher)
    ours = rows.get(("ember", workload, clients))
    if peer is None or ours is None:
        return ""
    mine, theirs = per_repeat(ours, attr), per_repeat(rows[(peer, workload, clients)], attr)
    ratios = paired_ratios(mine, theirs)
    fmt = "{:.1f}" if higher else "{:.3f}"
    label = {"tok_s": "tok/s", "ttft_p99": "TTFT p99 (s)", "ttft_p50": "TTFT p50 (s)"}[attr]
    text = (
        f"{label} {spread(list(mine.values()), fmt)} vs {spread(list(theirs.values()), fmt)} "
        f"({peer}) = {spread(ratios)}x"
    )
    if goal:
        op, _, bound = goal.partition(" ")
        ok = median(ratios) >= float(bound) if op == ">=" else median(ratios) <= float(bound)
        text += f" (goal {goal}: {'met' if ok else 'missed'}"
        if ratios and (min(ratios) >= float(bound) if op == ">=" else max(ratios) <= float(bound)):
            text += ", in every repeat"
        text += ")"
    return text


def verdict(results: list[LevelResult], raw: dict[int, float]) -> list[str]:
    """Every goal of issues 14 and 33 as a paired ratio (median and range over repeats), met or
    missed on the median; `raw` is the single-stream ceiling measured in each repeat."""
    rows = by_key(results)
    notes: list[str] = []
    levels = sorted({r.clients for r in results})
    for workload in dict.fromkeys(r.workload for r in results):
        for clients in levels:
            head = f"{workload}, {clients} clients:"
            tok_goal = ">= 1.1" if workload.startswith("distinct") and clients >= 8 else ""
            parts = [
                ratio_note(rows, workload, clients, "tok_s", tok_goal),
                ratio_note(rows, workload, clients, "ttft_p99", "<= 1"),
            ]
            if workload.startswith("shared-chat"):
                parts.append(ratio_note(rows, workload, clients, "ttft_p50", "<= 0.8"))
            if any(parts):
                notes.append(f"{head} " + "; ".join(p for p in parts if p))
            ours = rows.get(("ember", workload, clients))
            greedy = rows.get(("ember", workload.partition("/")[0] + "/greedy", clients))
            if ours and greedy and greedy is not ours:
                kept = paired_ratios(per_repeat(ours, "tok_s"), per_repeat(greedy, "tok_s"))
                notes.append(f"{head} Ember keeps {spread(kept)}x of its own greedy tok/s")
            slow = rows.get(("ember (deterministic)", workload, clients))
            if ours and slow:
                kept = paired_ratios(per_repeat(slow, "tok_s"), per_repeat(ours, "tok_s"))
                notes.append(f"{head} deterministic mode runs at {spread(kept)}x the default")
    single = rows.get(("ember", "distinct/greedy", 1))
    if single and raw:
        decode = {r.repeat: 1.0 / r.itl_p50 for r in single if r.itl_p50}
        ratios = paired_ratios(decode, raw)
        ok = "met" if median(ratios) >= 0.95 else "missed"
        notes.append(
            f"1 client: Ember decode {spread(list(decode.values()), '{:.1f}')} tok/s = "
            f"{spread(ratios)}x raw (goal >= 0.95: {ok})"
        )
    return notes


def plot(results: list[LevelResult], path: Path) -> None:
    """Medians over repeats, bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("tok_s", "output tok/s"), ("ttft_p99", "TTFT p99 (s)"), ("itl_p99", "ITL p99 (s)")]
    rows = by_key(results)
    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(
        len(workloads), len(metrics), figsize=(15, 3.6 * len(workloads)), squeeze=False
    )
    for row, workload in enumerate(workloads):
        for col, (attr, label) in enumerate(metrics):
            ax = axes[row][col]
            for name in dict.fromkeys(r.server for r in results):
                keys = sorted(k for k in rows if k[0] == name and k[1] == workload)
                if not keys:
                    continue
                values = [[getattr(r, attr) for r in rows[k]] for k in keys]
                mids = [median(v) for v in values]
                err = [
                    [m - min(v) for m, v in zip(mids, values, strict=True)],
                    [max(v) - m for m, v in zip(mids, values, strict=True)],
                ]
                ax.errorbar([k[2] for k in keys], mids, yerr=err, marker="o", capsize=3, label=name)
            ax.set(xlabel="concurrent streaming clients", ylabel=label, title=workload)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        "Gemma 3 270M Q4_K_M: distinct ~64-token prompts and a shared system prompt "
        "(median, min-max over repeats)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@contextlib.contextmanager
def cpu_lock(path: str) -> Iterator[None]:
    """The machine's benchmark lock (`flock PATH`), held for one repeat: between repeats other
    work may run, and the next repeat waits for the machine to be free again."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_interleaved(
    started: list[Server],
    workloads: list[str],
    levels: list[int],
    args: argparse.Namespace,
    model: Path,
) -> tuple[list[LevelResult], dict[int, list[float]]]:
    """`args.repeats` passes, each running every (workload, level) on every server in turn, the
    order rotating by one server per level (and carrying on from pass to pass); returns the
    results and, per repeat, the raw decode speeds measured around Ember's one-client level
    (that repeat's single-stream reference)."""
    results: list[LevelResult] = []
    bracket: dict[int, list[float]] = {}
    tokens, step = SHAPES["distinct"], 0
    for repeat in range(1, args.repeats + 1):
        with cpu_lock(args.lock):
            for workload in workloads:
                for clients in levels:
                    requests = max(args.requests, 3 * clients)
                    for server in started[step:] + started[:step]:
                        near = server.name == "ember" and workload == "distinct/greedy"
                        near = near and clients == 1
                        if near:
                            speed = raw_decode_speed(model, args.threads, tokens, repack=True)
                            bracket.setdefault(repeat, []).append(speed)
                        result = asyncio.run(run_level(server, workload, clients, requests, repeat))
                        if near:
                            speed = raw_decode_speed(model, args.threads, tokens, repack=True)
                            bracket[repeat].append(speed)
                        print(json.dumps(asdict(result)), flush=True)
                        results.append(result)
                    step = (step + 1) % len(started)
    return results, bracket


def report(summary: dict[str, Any]) -> str:
    """The markdown report of a summary (what `main` writes as JSON; `--replot` reads it)."""
    results = [LevelResult(**r) for r in summary["results"]]
    rss: dict[str, int] = summary["peak_rss_bytes"]
    bracket: dict[int, list[float]] = {int(k): v for k, v in summary["raw_decode_around"].items()}
    raw = {r: sum(v) / len(v) for r, v in bracket.items() if v}
    order = list(dict.fromkeys(r.server for r in results))
    workloads = list(dict.fromkeys(r.workload for r in results))
    results.sort(key=lambda r: (order.index(r.server), workloads.index(r.workload), r.clients))
    b, a = summary["load_average"]["before"], summary["load_average"]["after"]
    return "\n".join(
        [
            f"`{summary['command']}` (threads {summary['threads']}, {summary['cpus']} CPUs: "
            f"{summary['cpu']}; context {CTX_PER_SEQ} per sequence, {SLOTS} slots; llama-server "
            f"`-np {SLOTS} -c {CTX_PER_SEQ * SLOTS} -kvu --swa-full`, its prompt cache at its "
            "default (8 GiB) and at `--cache-ram 0`: each goal is judged against whichever is "
            "better for that goal at that row, the peer at its best); "
            f"{summary['repeats']} repeats, interleaved (every server once per repeat, in "
            "turns; the bench takes the machine's benchmark lock for each repeat); load average "
            f"(1/5/15 min) before {'/'.join(f'{x:.2f}' for x in b)}, after "
            f"{'/'.join(f'{x:.2f}' for x in a)}; {summary['cpu_stolen_s']:.1f} CPU-seconds "
            f"stolen by the hypervisor over the run; wall {summary['wall_s'] / 60:.0f} min",
            "",
            "Cells: median (min-max) over the repeats. Ratios are paired: Ember / peer within "
            "one repeat, then the median (min-max) of those; a goal is met on the median "
            "(`bench/paired.py`).",
            "",
            "What each server sampled with (every server gets the same request body; tokens are "
            "counted from each stream's usage):",
            "",
            *(
                f"- {mode}: Ember {SAMPLED_WITH['ember'][mode]}; llama-server "
                f"{SAMPLED_WITH['llama-server'][mode]}"
                for mode in SAMPLING
            ),
            "",
            table(results, rss),
            "",
            f"Raw single-stream llama_decode (no server), at the start: "
            f"{summary['raw_decode_tok_s']:.1f} tok/s with repacked weights, "
            f"{summary['raw_decode_no_repack_tok_s']:.1f} without; right before and after "
            "Ember's one-client level, per repeat: "
            + "; ".join(
                f"{r}: {' and '.join(f'{x:.1f}' for x in v)}" for r, v in sorted(bracket.items())
            )
            + " tok/s (each repeat's mean is its single-stream reference)",
            "",
            *(f"- {n}" for n in verdict(results, raw)),
        ]
    )


def write(summary: dict[str, Any], name: str) -> None:
    text = report(summary)
    print(text)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2))
    plot([LevelResult(**r) for r in summary["results"]], RESULTS / f"{name}.png")
    print(f"wrote {RESULTS}/{name}.{{md,json,png}}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument(
        "--requests", type=int, default=24, help="requests per level (at least; 3 per client)"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved passes (ranges, pairs)")
    p.add_argument("--lock", default="/tmp/ember-cpu.lock", help="flock per repeat; '' for none")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--servers", default="ember,llama-server,llama-server-cr0")
    p.add_argument("--model", type=Path)
    p.add_argument("--name", default="runtime_bench", help="results file stem")
    p.add_argument("--replot", type=Path, help="write the report of this JSON again; no run")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.replot:
        write(json.loads(args.replot.read_text()), args.name)
        return
    from tests.support.model import default_model_path

    # A bench stopped with SIGTERM still stops the servers it started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model or default_model_path()
    levels = [int(c) for c in args.clients.split(",")]
    workloads = [w if "/" in w else f"{w}/greedy" for w in args.workloads.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with cpu_lock(args.lock):
        raw = raw_decode_speed(model, args.threads, SHAPES["distinct"], repack=True)
        raw_plain = raw_decode_speed(model, args.threads, SHAPES["distinct"], repack=False)
    print(f"raw single-stream decode: {raw:.1f} tok/s ({raw_plain:.1f} without repack)")
    load_before, steal_before = os.getloadavg(), steal_seconds()
    rss: dict[str, int] = {}
    started: list[Server] = []
    try:
        for server in servers(model, args.threads, args.servers.split(",")):
            server.start(RESULTS)
            started.append(server)
        results, bracket = run_interleaved(started, workloads, levels, args, model)
    finally:
        for server in started:
            server.stop()
            rss[server.name] = server.peak_rss_bytes
    summary = {
        "command": "python bench/runtime_bench.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "repeats": args.repeats,
        "raw_decode_tok_s": raw,
        "raw_decode_no_repack_tok_s": raw_plain,
        "raw_decode_around": bracket,
        "peak_rss_bytes": rss,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cpu_stolen_s": steal_seconds() - steal_before,
        "wall_s": time.monotonic() - began,
        "results": [asdict(r) for r in results],
    }
    write(summary, args.name)


def git_commit() -> str:
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


if __name__ == "__main__":
    main()
