"""Ember's runtime vs llama.cpp's `llama-server` vs `python -m llama_cpp.server`, same run.

Same model (Gemma 3 270M Q4_K_M), same threads (2), same greedy sampling, same per-sequence
context (512 tokens). The servers: Ember (default, fast batching), Ember (`engine.deterministic:
true`), `llama-server -np 16` with its context, prompt cache and KV layout pinned (`-c 8192 -kvu
--cache-ram 256`: a unified 8192-cell pool, i.e. 512 per slot, and its RAM prompt cache on, as
it ships), and `python -m llama_cpp.server`.

One server is under load at a time, never two side by side, but all are started first and the
run goes level by level: each level runs every server in turn, the order rotating from level
to level. This machine's speed drifts by more than the goals' margins within minutes (raw
decode 58.5-70.7 tok/s in one half hour, no steal): run server after server, whichever ran in
a slow spell lost. Idle servers hold memory, not CPU. The single-stream ceiling, raw
`llama_decode`, is measured right before and right after Ember's one-client level and the
mean is its reference.

The load generator (one asyncio process, httpx + SSE, no per-token parsing beyond json.loads)
shares the cores with the server under test and is the same for every server. Levels of 1, 4,
8 and 16 concurrent streaming clients; at least 48 requests per level. Two workloads:

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

    .venv/bin/python bench/runtime_bench.py [--threads 2] [--clients 1,4,8,16] [--requests 48]

Writes `bench/results/runtime_bench.{md,json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import steal_seconds
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
    workload: str, index: int, max_tokens: int, level: int = 0
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
    serial: int,
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


async def run_level(server: Server, workload: str, clients: int, requests: int) -> LevelResult:
    """`requests` requests (rounded up to a multiple of `clients`), `clients` at a time, from
    this process's event loop."""
    per_client = -(-requests // clients)
    start_at = time.time() + 0.5  # after the connections are open
    stats, failures, _end = await run_clients(
        server.base,
        workload,
        clients,
        list(range(clients)),
        more=lambda turn: turn < per_client,
        serial=clients,
        start_at=start_at,
    )
    wall = time.time() - start_at
    return _level_result(server, workload, clients, wall, (stats, failures))


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


def table(results: list[LevelResult], rss: dict[str, int]) -> str:
    lines = [
        "| server | workload | clients | requests | tokens | tok/s | TTFT p50 (s) "
        "| TTFT p99 (s) | first wave: slowest TTFT (s) | ITL p50 (ms) | ITL p99 (ms) | errors "
        "| peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.server} | {r.workload} | {r.clients} | {r.requests} | {r.tokens} "
            f"| {r.tok_s:.1f} | {r.ttft_p50:.3f} | {r.ttft_p99:.3f} | {r.first_wave_ttft:.3f} "
            f"| {r.itl_p50 * 1e3:.1f} "
            f"| {r.itl_p99 * 1e3:.1f} | {r.errors} | {rss.get(r.server, 0) / 2**20:.0f} |"
        )
    return "\n".join(lines)


def peer_best(results: list[LevelResult], workload: str, clients: int) -> LevelResult | None:
    """The faster llama-server configuration at this workload and level: the peer at its best."""
    rows = [
        r
        for r in results
        if r.server.startswith("llama-server") and r.workload == workload and r.clients == clients
    ]
    return max(rows, key=lambda r: r.tok_s, default=None)


def verdict(results: list[LevelResult], raw: float | None) -> list[str]:
    """Every goal of issues 14 and 33 as a ratio, met or missed."""

    def get(name: str, workload: str, clients: int) -> LevelResult | None:
        return next(
            (
                r
                for r in results
                if r.server == name and r.workload == workload and r.clients == clients
            ),
            None,
        )

    notes: list[str] = []
    levels = sorted({r.clients for r in results})
    for workload in dict.fromkeys(r.workload for r in results):
        for clients in levels:
            ours, peer = get("ember", workload, clients), peer_best(results, workload, clients)
            if ours is None or peer is None or not peer.tok_s:
                continue
            ratio = ours.tok_s / peer.tok_s
            ttft = ours.ttft_p99 / peer.ttft_p99 if peer.ttft_p99 else float("nan")
            goal = ""
            if workload.startswith("distinct") and clients >= 8:
                goal = f" (goal >= 1.1: {'met' if ratio >= 1.1 else 'missed'})"
            notes.append(
                f"{workload}, {clients} clients: tok/s {ours.tok_s:.1f} vs {peer.tok_s:.1f} "
                f"({peer.server}) = {ratio:.2f}x{goal}; TTFT p99 {ours.ttft_p99:.3f} vs "
                f"{peer.ttft_p99:.3f} s = {ttft:.2f}x (goal <= 1: "
                f"{'met' if ttft <= 1.0 else 'missed'})"
            )
            if workload.startswith("shared-chat"):
                p50 = ours.ttft_p50 / peer.ttft_p50 if peer.ttft_p50 else float("nan")
                notes.append(
                    f"{workload}, {clients} clients: TTFT p50 {ours.ttft_p50:.3f} vs "
                    f"{peer.ttft_p50:.3f} s = {p50:.2f}x (goal <= 0.8)"
                )
            greedy = get("ember", workload.partition("/")[0] + "/greedy", clients)
            if greedy is not None and greedy is not ours and greedy.tok_s:
                notes.append(
                    f"{workload}, {clients} clients: Ember keeps {ours.tok_s / greedy.tok_s:.0%} "
                    "of its own greedy tok/s"
                )
            slow = get("ember (deterministic)", workload, clients)
            if slow is not None and ours.tok_s:
                notes.append(
                    f"{workload}, {clients} clients: deterministic mode costs "
                    f"{1 - slow.tok_s / ours.tok_s:.0%} of the default's tok/s"
                )
    single = get("ember", "distinct/greedy", 1)
    if single and raw and single.itl_p50:
        decode = 1.0 / single.itl_p50
        notes.append(
            f"1 client: Ember decode {decode:.1f} tok/s = {decode / raw:.2f}x raw (goal >= 0.95)"
        )
    return notes


def plot(results: list[LevelResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("tok_s", "output tok/s"), ("ttft_p99", "TTFT p99 (s)"), ("itl_p99", "ITL p99 (s)")]
    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(
        len(workloads), len(metrics), figsize=(15, 3.6 * len(workloads)), squeeze=False
    )
    for row, workload in enumerate(workloads):
        for col, (attr, label) in enumerate(metrics):
            ax = axes[row][col]
            for name in dict.fromkeys(r.server for r in results):
                rows = [r for r in results if r.server == name and r.workload == workload]
                if rows:
                    xs = [r.clients for r in rows]
                    ax.plot(xs, [getattr(r, attr) for r in rows], marker="o", label=name)
            ax.set(xlabel="concurrent streaming clients", ylabel=label, title=workload)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Gemma 3 270M Q4_K_M: distinct ~64-token prompts and a shared system prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_interleaved(
    started: list[Server],
    workloads: list[str],
    levels: list[int],
    args: argparse.Namespace,
    model: Path,
) -> tuple[list[LevelResult], list[float]]:
    """Every (workload, level) on every server in turn, the order rotating by one server per
    level; returns the results and the raw decode speeds measured around Ember's one-client
    level (the single-stream goal's reference)."""
    results: list[LevelResult] = []
    bracket: list[float] = []
    tokens, step = SHAPES["distinct"], 0
    for workload in workloads:
        for clients in levels:
            for server in started[step:] + started[:step]:
                near = server.name == "ember" and workload == "distinct/greedy" and clients == 1
                if near:
                    bracket.append(raw_decode_speed(model, args.threads, tokens, repack=True))
                result = asyncio.run(run_level(server, workload, clients, args.requests))
                if near:
                    bracket.append(raw_decode_speed(model, args.threads, tokens, repack=True))
                print(json.dumps(asdict(result)), flush=True)
                results.append(result)
            step = (step + 1) % len(started)
    return results, bracket


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=48, help="requests per level (at least)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--servers",
        default="ember,ember-deterministic,llama-server,llama-server-cr0,llama_cpp.server",
    )
    p.add_argument("--model", type=Path)
    p.add_argument("--name", default="runtime_bench", help="results file stem")
    args = p.parse_args()

    from ember_runtime.models import default_model_path

    # A bench stopped with SIGTERM still stops the servers it started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model or default_model_path()
    levels = [int(c) for c in args.clients.split(",")]
    workloads = [w if "/" in w else f"{w}/greedy" for w in args.workloads.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
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
    raw_near = sum(bracket) / len(bracket) if bracket else raw
    rank = {server.name: i for i, server in enumerate(started)}  # the table: server by server
    results.sort(key=lambda r: (rank[r.server], workloads.index(r.workload), r.clients))
    load_after, stolen = os.getloadavg(), steal_seconds() - steal_before
    loads = (
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)}; {stolen:.1f} CPU-seconds stolen "
        "by the hypervisor while the servers ran"
    )
    command = "python bench/runtime_bench.py " + " ".join(sys.argv[1:])
    cpu = cpu_model()
    report = "\n".join(
        [
            f"`{command}` (threads {args.threads}, {os.cpu_count()} CPUs: {cpu}; context "
            f"{CTX_PER_SEQ} per sequence, {SLOTS} slots; llama-server "
            f"`-np {SLOTS} -c {CTX_PER_SEQ * SLOTS} -kvu --swa-full`, its prompt cache at its "
            f"default (8 GiB) and at `--cache-ram 0`, the faster one per row is the peer in the "
            f"goals); {loads}",
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
            f"Raw single-stream llama_decode (no server), at the start: {raw:.1f} tok/s with "
            f"repacked weights, {raw_plain:.1f} without; right before and after Ember's "
            f"one-client level: {' and '.join(f'{x:.1f}' for x in bracket) or '-'} tok/s "
            "(their mean is the single-stream reference)",
            "",
            *(f"- {n}" for n in verdict(results, raw_near)),
        ]
    )
    print(report)
    (RESULTS / f"{args.name}.md").write_text(report + "\n")
    summary = {
        "command": command,
        "cpu": cpu,
        "raw_decode_tok_s": raw,
        "raw_decode_no_repack_tok_s": raw_plain,
        "raw_decode_around_single_stream_tok_s": bracket,
        "peak_rss_bytes": rss,
        "load_average": {"before": load_before, "after": load_after},
        "cpu_stolen_s": stolen,
        "results": [asdict(r) for r in results],
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=2))
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS}/{args.name}.{{md,json,png}}")


if __name__ == "__main__":
    main()
