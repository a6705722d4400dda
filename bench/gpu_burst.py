"""First-wave TTFT on the GPU: bursts of simultaneous requests, Ember vs `llama-server`.

A level of `gpu_bench.py` runs 8 requests per client; its TTFT p99 falls in the level's first
wave (every client's first request at once, on a fresh connection, after the previous level
drained), so it moves by tens of ms from run to run. This isolates that case and repeats it:
per server, `BURSTS` bursts of 8, 32 and 64 requests sent together on connections opened
beforehand (each burst's prompts distinct), with 4 and with 64 tokens out, 0.3 s apart. Reported:
TTFT p50/p99 over all requests of a size, each burst's slowest first token, and for Ember the
engine steps each burst took (`ember_engine_step_seconds_count` in /metrics).

Runs on the GPU machine with `gpu_bench.py`'s setup (`BENCH=burst bash bench/gpu_run.sh`):

    python bench/gpu_burst.py --llama-server BIN --models DIR --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_bench import ember_server, llama_server
from bench.gpu_models import write_model
from bench.runtime_bench import Server, one_request, pct, request_body

SIZES = (8, 32, 64)
MAX_TOKENS = (4, 64)
BURSTS = 12
SLOTS = 64


def engine_steps(server: Server) -> float | None:
    """Ember's engine step count (None for a server without it)."""
    text = httpx.get(server.base + "/metrics", timeout=5).text
    found = re.search(r"^ember_engine_step_seconds_count (\S+)", text, re.M)
    return float(found.group(1)) if found else None


async def burst(server: Server, size: int, serial: int, max_tokens: int) -> list[float]:
    limits = httpx.Limits(max_connections=size + 2)
    async with httpx.AsyncClient(base_url=server.base, timeout=60, limits=limits) as client:
        # Connections first: the burst measures serving, not TCP and HTTP setup.
        await asyncio.gather(*(client.get("/v1/models") for _ in range(size)))
        bodies = [
            request_body("distinct", serial * 100 + i, max_tokens, 900 + size) for i in range(size)
        ]
        stats = await asyncio.gather(*(one_request(client, p, b) for p, b in bodies))
    return [s.ttft for s in stats]


def measure(server: Server, size: int, max_tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    worst: list[float] = []
    steps: list[float] = []
    for k in range(BURSTS):
        before = engine_steps(server)
        got = asyncio.run(burst(server, size, k + 100 * max_tokens, max_tokens))
        after = engine_steps(server)
        ttfts += got
        worst.append(round(max(got), 4))
        if before is not None and after is not None:
            steps.append(after - before)
        time.sleep(0.3)
    return {
        "size": size,
        "max_tokens": max_tokens,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "worst_per_burst": sorted(worst),
        "steps_per_burst": steps,
    }


def markdown(results: dict[str, dict[str, Any]]) -> str:
    out = [
        "# First-wave TTFT on the H200: bursts of simultaneous requests (llama-8b shape)",
        "",
        f"{BURSTS} bursts per size, connections opened before each burst, 0.3 s apart "
        "(`bench/gpu_burst.py`). Worst = the slowest first token of a burst (median and max "
        "over the bursts).",
        "",
        "| server | burst | tokens out | TTFT p50 (ms) | TTFT p99 (ms) | worst, median (ms) "
        "| worst, max (ms) | engine steps per burst |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, r in results.items():
        worst = r["worst_per_burst"]
        steps = r["steps_per_burst"]
        out.append(
            f"| {key.split('/')[0]} | {r['size']} | {r['max_tokens']} | "
            f"{r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | "
            f"{worst[len(worst) // 2] * 1e3:.0f} | {worst[-1] * 1e3:.0f} | "
            f"{f'{min(steps):.0f}-{max(steps):.0f}' if steps else '-'} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--markdown-only", type=Path, help="rewrite the .md from this results JSON")
    args = ap.parse_args()
    if args.markdown_only is not None:
        (args.out / "gpu_burst.md").write_text(markdown(json.loads(args.markdown_only.read_text())))
        return
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    model = write_model("llama-8b", args.models)
    results: dict[str, dict[str, Any]] = {}
    for server in (
        ember_server(model, SLOTS, work, None),
        llama_server(args.llama_server, model, SLOTS),
    ):
        server.start(work)
        try:
            for size in SIZES:
                for max_tokens in MAX_TOKENS:
                    row = measure(server, size, max_tokens)
                    results[f"{server.name}/{size}/{max_tokens}"] = row
                    print(server.name, json.dumps(row), flush=True)
        finally:
            server.stop()
    (args.out / "gpu_burst.json").write_text(json.dumps(results, indent=1))
    (args.out / "gpu_burst.md").write_text(markdown(results))
    print(markdown(results), flush=True)


if __name__ == "__main__":
    main()
