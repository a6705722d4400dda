"""What the site gateway adds to a request's latency at one client: gateway vs direct, one replica.

One runtime process (the real engine on Gemma 3 270M, 1 thread) and one gateway process
(`python -m ember_runtime.gateway --static`, routing to that runtime) run side by side; one
client (httpx, keep-alive, one connection to each) sends the same request alternately to the
runtime and through the gateway, so drift of this shared machine hits both sides alike. Two
requests:

* `proxy-path`: `POST /v1/embeddings` with a model the gateway knows, to a generating runtime,
  which refuses it at once (404, or 400 where the runtime serves embeddings for embed
  deployments only), so the time is HTTP, parsing, authentication, the choice and the relay,
  with no engine work to hide behind;
* `completion-1-token`: `POST /v1/completions`, a short prompt, `max_tokens` 1, greedy.

Reported per request: p50 and p90 direct and through the gateway, the added p50 (difference of
the medians), its bootstrap 95% interval, and the added p50 of each fifth of the run (a range
that shows drift); the load average and the steal time over the run.

    flock /tmp/ember-bench.lock .venv/bin/python bench/gateway_overhead.py [--repeats 2000]

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
from pathlib import Path
from typing import Any

import httpx
from ember_runtime.models import default_model_path

from bench.machine import steal_seconds
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "gemma-3-270m"
GOAL_SECONDS = 0.001


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


def measure(
    direct: httpx.Client, gateway: httpx.Client, path: str, body: dict[str, Any], repeats: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    for i in range(repeats + 20):
        pair = [("direct", direct), ("gateway", gateway)]
        if i % 2:
            pair.reverse()  # neither side always goes first
        for name, client in pair:
            began = time.perf_counter()
            client.post(path, json=body)
            if i >= 20:  # warm-up: connections, caches
                times[name].append(time.perf_counter() - began)
    return times


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if q < 100 else max(values)


def summarise(times: dict[str, list[float]], gateway_cpu: float, wall: float) -> dict[str, Any]:
    d, g = times["direct"], times["gateway"]
    rng = random.Random(7)
    boot = sorted(
        statistics.median(rng.choices(g, k=len(g))) - statistics.median(rng.choices(d, k=len(d)))
        for _ in range(1000)
    )
    fifth = len(d) // 5
    blocks = [
        statistics.median(g[k * fifth : (k + 1) * fifth])
        - statistics.median(d[k * fifth : (k + 1) * fifth])
        for k in range(5)
    ]
    return {
        "n": len(d),
        "direct_p50_ms": statistics.median(d) * 1e3,
        "gateway_p50_ms": statistics.median(g) * 1e3,
        "direct_p90_ms": p(d, 90) * 1e3,
        "gateway_p90_ms": p(g, 90) * 1e3,
        "added_p50_ms": (statistics.median(g) - statistics.median(d)) * 1e3,
        "added_p50_ci95_ms": [boot[25] * 1e3, boot[974] * 1e3],
        "added_p50_by_fifth_ms": [b * 1e3 for b in blocks],
        # the median of each pair's difference (both sides of a pair ran back to back)
        "paired_median_ms": statistics.median(gi - di for gi, di in zip(g, d, strict=True)) * 1e3,
        # the gateway process's CPU time per request it relayed (probes included): what the
        # added latency comes down to on an idle machine, whatever the load on this one
        "gateway_cpu_per_request_ms": gateway_cpu / (len(g) + 20) * 1e3,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--completion-repeats", type=int, default=400)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
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
    procs = [start(runtime_argv, f"http://127.0.0.1:{rport}/readyz", work / "runtime.log")]
    procs.append(start(gateway_argv, f"http://127.0.0.1:{gport}/readyz", work / "gateway.log"))
    load_before, steal_before = os.getloadavg(), steal_seconds()
    results: dict[str, Any] = {}
    results_idle = 0.0
    try:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{rport}", timeout=60) as direct,
            httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=60) as gateway,
        ):
            embed = {"model": MODEL, "input": "hello"}
            # the runtime refuses at once: 404 where it has no embeddings route, 400 on a
            # generating deployment where it has one; either way no engine work
            status = direct.post("/v1/embeddings", json=embed).status_code
            assert (
                400 <= status < 500
                and gateway.post("/v1/embeddings", json=embed).status_code == status
            )
            body = {
                "model": MODEL,
                "prompt": "The capital of France is",
                "max_tokens": 1,
                "temperature": 0,
            }
            # the gateway's own background (its probes, 2.5 a second) is measured idle and
            # taken off the CPU per request
            cpu, began = cpu_seconds(procs[1].pid), time.monotonic()
            time.sleep(5)
            idle_rate = (cpu_seconds(procs[1].pid) - cpu) / (time.monotonic() - began)
            for name, path, doc, n in (
                ("proxy-path", "/v1/embeddings", embed, args.repeats),
                ("completion-1-token", "/v1/completions", body, args.completion_repeats),
            ):
                cpu, began = cpu_seconds(procs[1].pid), time.monotonic()
                times = measure(direct, gateway, path, doc, n)
                wall = time.monotonic() - began
                used = cpu_seconds(procs[1].pid) - cpu - idle_rate * wall
                results[name] = summarise(times, used, wall)
            results_idle = idle_rate
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    out = {
        "requests": results,
        "goal_added_p50_ms": GOAL_SECONDS * 1e3,
        "gateway_idle_cpu_per_second": results_idle,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "steal_seconds": steal_seconds() - steal_before,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "gateway.md").write_text(render(out))
    print(render(out))


def render(out: dict[str, Any]) -> str:
    lines = [
        "# Gateway overhead at one client (bench/gateway_overhead.py)",
        "",
        f"{out['date']}, {out['cpus']} CPUs; load average before {out['loadavg_before'][0]:.2f}, "
        f"after {out['loadavg_after'][0]:.2f}; steal over the run {out['steal_seconds']:.1f} s.",
        "One runtime (Gemma 3 270M, 1 thread) and one gateway process; one client alternating "
        "direct and through the gateway on keep-alive connections. Gateway CPU per request: "
        "its process's CPU time over the run, less its idle rate "
        f"({out['gateway_idle_cpu_per_second'] * 1e3:.1f} ms/s, the probes), per request.",
        "",
        "| request | n | direct p50 | gateway p50 | direct p90 | gateway p90 | added p50 | "
        "95% CI | by fifth | paired median | gateway CPU/request | goal ≤ 1 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in out["requests"].items():
        lo, hi = r["added_p50_ci95_ms"]
        fifths = ", ".join(f"{b:.2f}" for b in r["added_p50_by_fifth_ms"])
        met = "met" if r["added_p50_ms"] <= out["goal_added_p50_ms"] else "missed"
        lines.append(
            f"| {name} | {r['n']} | {r['direct_p50_ms']:.2f} ms | {r['gateway_p50_ms']:.2f} ms | "
            f"{r['direct_p90_ms']:.2f} ms | {r['gateway_p90_ms']:.2f} ms | "
            f"**{r['added_p50_ms']:.2f} ms** | {lo:.2f}–{hi:.2f} | {fifths} | "
            f"{r['paired_median_ms']:.2f} ms | {r['gateway_cpu_per_request_ms']:.2f} ms | {met} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
