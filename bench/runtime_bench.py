"""Ember's runtime vs llama.cpp's `llama-server` vs `python -m llama_cpp.server`, same run.

Same model (Gemma 3 270M Q4_K_M), same thread count, same per-sequence context, same prompts.
Each server runs alone (one after the other) so they never compete for the cores. Load: N
concurrent streaming clients (httpx + SSE), ~64-token prompts, max_tokens 64, greedy, a bounded
number of requests per client. Reported per server and concurrency: aggregate output tok/s,
TTFT p50/p99, inter-token latency p50/p99; plus raw single-stream `llama_decode` speed (no
server) as the ceiling for one stream.

    .venv/bin/python bench/runtime_bench.py [--threads 1] [--clients 1,4,8] [--requests 3]

Writes `bench/results/runtime_bench.{md,json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llama_server_build import ensure_llama_server

RESULTS = Path(__file__).resolve().parent / "results"
CTX_PER_SEQ = 512
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
PROMPTS = [
    (
        f"Write a long, detailed story about {topic}. Describe the setting, the weather, the "
        "sounds and the smells, introduce every character with care, and do not stop early. "
        "Use simple words and short sentences. The story begins like this: It was"
    )
    for topic in _TOPICS
]


@dataclass
class RequestStats:
    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class LevelResult:
    server: str
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


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

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

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestStats:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.perf_counter()
    last: float | None = None
    ttft = 0.0
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if not choices or not choices[0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                ttft = now - began
            else:
                gaps.append(now - last)
            last = now
            tokens += 1
    return RequestStats(ttft, gaps, tokens)


async def run_level(server: Server, clients: int, per_client: int, max_tokens: int) -> LevelResult:
    stats: list[RequestStats] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=server.base, timeout=600, limits=limits) as client:

        async def worker(index: int) -> None:
            nonlocal errors
            for i in range(per_client):
                prompt = PROMPTS[(index + i * clients) % len(PROMPTS)]
                try:
                    stats.append(await one_request(client, prompt, max_tokens))
                except httpx.HTTPError:
                    errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - began
    tokens = sum(s.tokens for s in stats)
    ttfts = [s.ttft for s in stats]
    gaps = [g for s in stats for g in s.gaps]
    return LevelResult(
        server=server.name,
        clients=clients,
        requests=len(stats),
        tokens=tokens,
        wall=wall,
        tok_s=tokens / wall,
        ttft_p50=pct(ttfts, 0.5),
        ttft_p99=pct(ttfts, 0.99),
        itl_p50=pct(gaps, 0.5),
        itl_p99=pct(gaps, 0.99),
        errors=errors,
    )


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


def ember_config(model: Path, engine_args: dict[str, str]) -> Path:
    """A RuntimeConfig file carrying `engine.args` (the CLI has no flag for them)."""
    path = RESULTS / "ember-bench-config.yaml"
    engine = {"args": engine_args}
    config = {"modelName": model.stem, "modelDir": str(model.parent), "engine": engine}
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def servers(
    model: Path, threads: int, batch: int, which: list[str], engine_args: dict[str, str]
) -> list[Server]:
    made: list[Server] = []
    t = str(threads)
    if "ember" in which:
        port = free_port()
        made.append(
            Server(
                "ember",
                [
                    sys.executable,
                    "-m",
                    "ember_runtime.server",
                    "--config",
                    str(ember_config(model, engine_args)),
                    "--model",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--threads",
                    t,
                    "--max-batch-size",
                    str(batch),
                    "--context-length",
                    str(CTX_PER_SEQ),
                    "--max-queue",
                    "256",
                    "--log-level",
                    "warning",
                ],
                port,
            )
        )
    if "llama-server" in which:
        port = free_port()
        made.append(
            Server(
                f"llama-server -np {batch}",
                [
                    str(ensure_llama_server()),
                    "-m",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-t",
                    t,
                    "-tb",
                    t,
                    "-np",
                    str(batch),
                    "-c",
                    str(CTX_PER_SEQ * batch),
                    "--log-disable",
                ],
                port,
            )
        )
    if "llama_cpp.server" in which:
        port = free_port()
        made.append(
            Server(
                "llama_cpp.server",
                [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--n_threads",
                    t,
                    "--n_threads_batch",
                    t,
                    "--n_ctx",
                    str(CTX_PER_SEQ),
                    "--interrupt_requests",
                    "False",
                    "--verbose",
                    "False",
                ],
                port,
            )
        )
    return made


def table(results: list[LevelResult], raw: float | None) -> str:
    lines = [
        "| server | clients | requests | tokens | tok/s | TTFT p50 (s) | TTFT p99 (s) "
        "| ITL p50 (ms) | ITL p99 (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.server} | {r.clients} | {r.requests} | {r.tokens} | {r.tok_s:.1f} "
            f"| {r.ttft_p50:.3f} | {r.ttft_p99:.3f} | {r.itl_p50 * 1e3:.1f} "
            f"| {r.itl_p99 * 1e3:.1f} | {r.errors} |"
        )
    if raw is not None:
        lines.append(f"\nRaw single-stream llama_decode (no server): {raw:.1f} tok/s")
    return "\n".join(lines)


def verdict(results: list[LevelResult], raw: float | None, batch: int) -> list[str]:
    def get(name: str, clients: int) -> LevelResult | None:
        return next((r for r in results if r.server == name and r.clients == clients), None)

    notes: list[str] = []
    top = max(r.clients for r in results)
    ours, peer = get("ember", top), get(f"llama-server -np {batch}", top)
    if ours and peer:
        notes.append(
            f"{top} clients: Ember/llama-server tok/s = {ours.tok_s / peer.tok_s:.2f}x, "
            f"TTFT p99 {ours.ttft_p99:.3f}s vs {peer.ttft_p99:.3f}s"
        )
    slow = get("llama_cpp.server", top)
    if ours and slow:
        notes.append(
            f"{top} clients: Ember/llama_cpp.server tok/s = {ours.tok_s / slow.tok_s:.2f}x"
        )
    single = get("ember", 1)
    if single and raw:
        decode = 1.0 / single.itl_p50 if single.itl_p50 else 0.0
        notes.append(f"1 client: Ember decode {decode:.1f} tok/s = {decode / raw:.2f}x raw")
    return notes


def plot(results: list[LevelResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r.server for r in results):
        rows = [r for r in results if r.server == name]
        xs = [r.clients for r in rows]
        left.plot(xs, [r.tok_s for r in rows], marker="o", label=name)
        right.plot(xs, [r.ttft_p99 for r in rows], marker="o", label=name)
    left.set(xlabel="concurrent streaming clients", ylabel="aggregate output tok/s")
    right.set(xlabel="concurrent streaming clients", ylabel="TTFT p99 (s)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Gemma 3 270M Q4_K_M, 64-token prompts and outputs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="Ember max batch = llama-server -np")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--requests", type=int, default=3, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--servers", default="ember,llama-server,llama_cpp.server")
    p.add_argument("--model", type=Path)
    p.add_argument(
        "--ember-args",
        default="",
        help="Ember engine.args as k=v,k=v (e.g. prefixCache=true,repack=true)",
    )
    p.add_argument("--name", default="runtime_bench", help="results file stem")
    args = p.parse_args()
    engine_args = dict(kv.split("=", 1) for kv in args.ember_args.split(",") if kv)

    from ember_runtime.models import default_model_path

    model = args.model or default_model_path()
    levels = [int(c) for c in args.clients.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = raw_decode_speed(model, args.threads, args.max_tokens, repack=True)
    raw_plain = raw_decode_speed(model, args.threads, args.max_tokens, repack=False)
    print(f"raw single-stream decode: {raw:.1f} tok/s ({raw_plain:.1f} without repack)")
    results: list[LevelResult] = []
    for server in servers(model, args.threads, args.batch, args.servers.split(","), engine_args):
        server.start(RESULTS)
        try:
            for clients in levels:
                result = asyncio.run(run_level(server, clients, args.requests, args.max_tokens))
                print(json.dumps(asdict(result)), flush=True)
                results.append(result)
        finally:
            server.stop()
    command = "python bench/runtime_bench.py " + " ".join(sys.argv[1:])
    report = "\n".join(
        [
            f"`{command}` (threads {args.threads}, Ember engine.args {engine_args or 'defaults'})",
            "",
            table(results, raw),
            f"Raw single-stream llama_decode without weight repack: {raw_plain:.1f} tok/s",
            "",
            *(f"- {n}" for n in verdict(results, raw, args.batch)),
        ]
    )
    print(report)
    (RESULTS / f"{args.name}.md").write_text(report + "\n")
    summary = {
        "command": command,
        "ember_engine_args": engine_args,
        "raw_decode_tok_s": raw,
        "raw_decode_no_repack_tok_s": raw_plain,
        "results": [asdict(r) for r in results],
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=2))
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS}/{args.name}.{{md,json,png}}")


if __name__ == "__main__":
    main()
