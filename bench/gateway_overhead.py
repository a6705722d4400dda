"""What the site gateway adds to a request's latency at one client: gateway vs direct, one replica.

One runtime process (the real engine on Gemma 3 270M, 1 thread) and one gateway process
(`python -m ember_runtime.gateway --static`, routing to that runtime) run side by side; one
client (httpx, keep-alive, one connection to each) sends the same request to the runtime and
through the gateway back to back (a pair; which side goes first alternates), so drift of this
shared machine hits both sides of a pair alike. Requests:

* `completion-1-token`: `POST /v1/completions`, a short prompt, `max_tokens` 1, greedy: the
  time to the response's last byte;
* `chat-stream`: `POST /v1/chat/completions`, streamed, a short maintenance question with a
  one-sentence instruction, greedy, `CHAT_MAX_TOKENS` tokens (a short reply's length; the
  packaged model is a base checkpoint that echoes the prompt rather than answering it, so the
  length is a reply's, not the words): the time to the first content chunk (TTFT) and to the
  last byte;
* `refused` (a diagnostic, no goal): `POST /v1/embeddings` to a generating runtime, which refuses
  it at once (404, or 400 where the runtime serves embeddings for embed deployments only):
  HTTP, parsing, authentication, the choice and the relay with no engine work beside them.

One method for every comparison (bench/paired.py): the pair is the repeat. Added p50 = the
median of the paired differences (gateway − direct of one pair), with a bootstrap 95% interval
over pairs; ratio = the median of the paired ratios (gateway / direct of one pair), its range the
min–max of that median over the run's five fifths (drift shows there). The goal, the gateway
adds ≤ 1 ms at p50, is met where the interval lies below 1 ms, missed where it lies above, and
not resolved where it spans 1 ms. Also: p50 and p90 of each side, the gateway process's CPU per
request, the load average and the steal time over the run.

    flock /tmp/ember-cpu.lock .venv/bin/python bench/gateway_overhead.py [--repeats 2000]
        [--completion-repeats 400] [--chat-repeats 200]

Writes `bench/results/gateway.{md,json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import steal_seconds
from bench.paired import median
from bench.runtime_bench import chunk_text
from tests.support.model import default_model_path
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "gemma-3-270m"
GOAL_SECONDS = 0.001
WARM_UP = 20  # pairs before the clock: connections, caches
CHAT_MAX_TOKENS = 48
CHAT_MESSAGES = [
    {"role": "system", "content": "You help a maintenance team. Answer in one short sentence."},
    {
        "role": "user",
        "content": "The water pump at Old Mill reports low pressure. What should we check first?",
    },
]


@dataclass(frozen=True)
class Kind:
    """One request kind: what is sent, how many pairs, which times are kept."""

    name: str
    path: str
    body: dict[str, Any]
    pairs: int
    stream: bool = False  # keep the first content chunk's time (TTFT) beside the last byte's
    goal: bool = True  # judged against the ≤ 1 ms goal (the refused request is a diagnostic)

    @property
    def metrics(self) -> tuple[str, ...]:
        return ("ttft", "last_byte") if self.stream else ("last_byte",)


def kinds(args: argparse.Namespace) -> list[Kind]:
    completion = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    chat = {"messages": CHAT_MESSAGES, "max_tokens": CHAT_MAX_TOKENS, "temperature": 0}
    return [
        Kind("completion-1-token", "/v1/completions", {"model": MODEL, **completion},
             args.completion_repeats),
        Kind("chat-stream", "/v1/chat/completions", {"model": MODEL, **chat, "stream": True},
             args.chat_repeats, stream=True),
        Kind("refused", "/v1/embeddings", {"model": MODEL, "input": "hello"}, args.repeats,
             goal=False),
    ]  # fmt: skip


def start(argv: list[str], ready: str, log: Path) -> subprocess.Popen[bytes]:
    # the caller's path stays behind the checkout's (where the packages are not a venv's, e.g.
    # the device machine's carried wheels)
    paths = [f"{ROOT}/runtime", f"{ROOT}/operator", str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[2]} exited early; see {log}")
        try:
            if httpx.get(ready, timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{argv[2]} did not become ready; see {log}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (/proc/<pid>/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(client: httpx.Client, kind: Kind) -> dict[str, Any]:
    """The first content chunk's and the last byte's time in seconds from the send (a request
    that is not streamed has its last byte as its first), the content chunks and the reply."""
    began = time.perf_counter()
    first, texts = 0.0, list[str]()
    with client.stream("POST", kind.path, json=kind.body) as response:
        for line in response.iter_lines():
            if not (kind.stream and line.startswith("data: {")):
                continue
            if text := chunk_text(json.loads(line[6:])):
                first = first or time.perf_counter() - began
                texts.append(text)
    last = time.perf_counter() - began
    return {"ttft": first or last, "last_byte": last, "chunks": len(texts), "reply": "".join(texts)}


def measure(direct: httpx.Client, gateway: httpx.Client, kind: Kind) -> dict[str, Any]:
    """Per side and metric, one time per pair (warm-up pairs dropped); per side each reply and
    its content chunks (a greedy reply must be alike on both sides)."""
    keys = (*kind.metrics, "chunks", "reply")
    out: dict[str, Any] = {s: {k: [] for k in keys} for s in ("direct", "gateway")}
    for i in range(kind.pairs + WARM_UP):
        pair = [("direct", direct), ("gateway", gateway)]
        if i % 2:
            pair.reverse()  # neither side always goes first
        for side, client in pair:
            got = timed(client, kind)
            if i >= WARM_UP:
                for key, values in out[side].items():
                    values.append(got[key])
    return out


def fifths(values: list[float]) -> list[list[float]]:
    size = len(values) // 5
    return [values[k * size : (k + 1) * size] for k in range(5)]


def verdict(ci: list[float]) -> str:
    """The goal against the added p50's 95% interval (milliseconds)."""
    goal = GOAL_SECONDS * 1e3
    return "met" if ci[1] <= goal else "missed" if ci[0] > goal else "not resolved"


def paired_stats(direct: list[float], gateway: list[float]) -> dict[str, Any]:
    """One metric, gateway against direct, pair by pair (bench/paired.py's method: the pair is
    the repeat)."""
    diffs = [g - d for g, d in zip(gateway, direct, strict=True)]
    ratios = [g / d for g, d in zip(gateway, direct, strict=True)]
    rng = random.Random(7)
    boot = sorted(median(rng.choices(diffs, k=len(diffs))) for _ in range(1000))
    ci = [boot[25] * 1e3, boot[974] * 1e3]
    by_fifth = [median(r) for r in fifths(ratios)]
    return {
        "n": len(diffs),
        "direct_p50_ms": median(direct) * 1e3,
        "gateway_p50_ms": median(gateway) * 1e3,
        "direct_p90_ms": statistics.quantiles(direct, n=10)[8] * 1e3,
        "gateway_p90_ms": statistics.quantiles(gateway, n=10)[8] * 1e3,
        "added_p50_ms": median(diffs) * 1e3,
        "added_p50_ci95_ms": ci,
        "added_p50_by_fifth_ms": [median(d) * 1e3 for d in fifths(diffs)],
        "ratio": median(ratios),
        "ratio_by_fifth": by_fifth,
        "ratio_range": [min(by_fifth), max(by_fifth)],
        "verdict": verdict(ci),
    }


def summarise(kind: Kind, times: dict[str, Any], gateway_cpu: float, wall: float) -> dict[str, Any]:
    d, g = times["direct"], times["gateway"]
    return {
        "path": kind.path,
        "stream": kind.stream,
        "goal": kind.goal,
        "metrics": {m: paired_stats(d[m], g[m]) for m in kind.metrics},
        # a greedy reply is the same on both sides: the same work behind both times
        "content_chunks": sorted(set(d["chunks"]) | set(g["chunks"])),
        "replies": sorted(set(d["reply"]) | set(g["reply"])),
        # the gateway process's CPU time per request it relayed (probes taken off): what the
        # added latency comes down to on an idle machine, whatever the load on this one
        "gateway_cpu_per_request_ms": gateway_cpu / (len(g["last_byte"]) + WARM_UP) * 1e3,
        "wall_s": wall,
    }


def processes(work: Path) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    """The runtime and the gateway over it, ready; their base URLs."""
    rport, gport = free_port(), free_port()
    runtime_argv = [sys.executable, "-m", "ember_runtime.server", "--model",
                    str(default_model_path()), "--port", str(rport), "--threads", "1",
                    "--max-batch-size", "4", "--log-level", "warning"]  # fmt: skip
    routes = work / "routes.json"
    routes.write_text(
        json.dumps({"models": [{"name": MODEL, "replicas": [f"http://127.0.0.1:{rport}"]}]})
    )
    gateway_argv = [sys.executable, "-m", "ember_runtime.gateway", "--static", str(routes),
                    "--host", "127.0.0.1", "--port", str(gport)]  # fmt: skip
    runtime, gateway = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{gport}"
    procs = [start(runtime_argv, f"{runtime}/readyz", work / "runtime.log")]
    procs.append(start(gateway_argv, f"{gateway}/readyz", work / "gateway.log"))
    return procs, runtime, gateway


def run(kinds_: list[Kind], gateway_pid: int, runtime: str, gateway: str) -> dict[str, Any]:
    with (
        httpx.Client(base_url=runtime, timeout=60) as direct,
        httpx.Client(base_url=gateway, timeout=60) as through,
    ):
        for kind in kinds_:  # every request answers alike on both sides before the clock
            status = direct.post(kind.path, json=kind.body).status_code
            assert through.post(kind.path, json=kind.body).status_code == status, kind.name
            assert (status == 200) == kind.goal, f"{kind.name}: {status}"
        # the gateway's own background (its probes, 2.5 a second) is measured idle and taken
        # off the CPU per request
        cpu, began = cpu_seconds(gateway_pid), time.monotonic()
        time.sleep(5)
        idle_rate = (cpu_seconds(gateway_pid) - cpu) / (time.monotonic() - began)
        results: dict[str, Any] = {}
        for kind in kinds_:
            cpu, began = cpu_seconds(gateway_pid), time.monotonic()
            times = measure(direct, through, kind)
            wall = time.monotonic() - began
            used = cpu_seconds(gateway_pid) - cpu - idle_rate * wall
            results[kind.name] = summarise(kind, times, used, wall)
            print(f"{kind.name}: {wall:.0f} s", flush=True)
    return {"requests": results, "gateway_idle_cpu_per_second": idle_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2000, help="pairs of the refused request")
    ap.add_argument("--completion-repeats", type=int, default=400)
    ap.add_argument("--chat-repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    procs, runtime, gateway = processes(Path(tempfile.mkdtemp(prefix="gateway-overhead-")))
    load_before, steal_before = os.getloadavg(), steal_seconds()
    began = time.monotonic()
    try:
        out = run(kinds(args), procs[1].pid, runtime, gateway)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    out |= {
        "goal_added_p50_ms": GOAL_SECONDS * 1e3,
        "method": "paired: the pair (direct and gateway back to back) is the repeat; added p50 "
        "= median of paired differences, 95% CI by bootstrap over pairs; ratio = median of "
        "paired ratios, range = min-max of that median over the run's fifths",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "steal_seconds": steal_seconds() - steal_before,
        "wall_s": time.monotonic() - began,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / "gateway.md").write_text(render(out))
    print(render(out))


def render(out: dict[str, Any]) -> str:
    lines = [
        "# Gateway overhead at one client (bench/gateway_overhead.py)",
        "",
        f"{out['date']}, {out['cpus']} CPUs; load average before {out['loadavg_before'][0]:.2f}, "
        f"after {out['loadavg_after'][0]:.2f}; steal over the run {out['steal_seconds']:.1f} s; "
        f"{out['wall_s']:.0f} s in all.",
        "One runtime (Gemma 3 270M, 1 thread) and one gateway process; one client sending each "
        "request direct and through the gateway back to back (a pair) on keep-alive "
        "connections. Paired throughout: added p50 = median of the paired differences "
        "(gateway − direct), 95% CI by bootstrap over pairs, and per fifth of the run; ratio = "
        "median of the paired ratios (gateway / direct), range = min–max of it over the fifths. "
        f"Goal: the gateway adds ≤ {out['goal_added_p50_ms']:.0f} ms at p50 — met where the CI "
        "lies below, missed where it lies above, not resolved where it spans it. Gateway CPU "
        "per request: its process's CPU time over the kind's run, less its idle rate "
        f"({out['gateway_idle_cpu_per_second'] * 1e3:.1f} ms/s, the probes), per request.",
        "",
        "| request | time to | n | direct p50 | gateway p50 | direct p90 | gateway p90 | "
        "added p50 | 95% CI | by fifth | ratio | gateway CPU/request | goal ≤ 1 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in out["requests"].items():
        for metric, m in r["metrics"].items():
            lines.append(_row(name, metric, r, m))
    for name, r in out["requests"].items():
        if r["stream"]:
            lines += ["", f"{name}: content chunks per reply (every pair, both sides) "
                      f"{r['content_chunks']}; the replies: {r['replies']}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _row(name: str, metric: str, r: dict[str, Any], m: dict[str, Any]) -> str:
    lo, hi = m["added_p50_ci95_ms"]
    fifths_ = ", ".join(f"{b:.2f}" for b in m["added_p50_by_fifth_ms"])
    rlo, rhi = m["ratio_range"]
    goal = m["verdict"] if r["goal"] else "diagnostic"
    return (
        f"| {name} | {metric.replace('_', ' ')} | {m['n']} | {m['direct_p50_ms']:.2f} ms | "
        f"{m['gateway_p50_ms']:.2f} ms | {m['direct_p90_ms']:.2f} ms | "
        f"{m['gateway_p90_ms']:.2f} ms | **{m['added_p50_ms']:.2f} ms** | {lo:.2f}–{hi:.2f} | "
        f"{fifths_} | {m['ratio']:.3f} ({rlo:.3f}–{rhi:.3f}) | "
        f"{r['gateway_cpu_per_request_ms']:.2f} ms | {goal} |"
    )


if __name__ == "__main__":
    main()
