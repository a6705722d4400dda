"""How long one prompt takes to its first token, by Ember's per-sequence prompt chunk
(`engine.chunkTokens`) against llama-server at its defaults (n_batch 2048, n_ubatch 512).

A lone request (max_tokens 1, greedy) of each long workload (bench/workloads.py: code edit
~800 tokens, RAG ~1,540, summary), so the time is the prompt's prefill and one token. Every
server answers each prompt in turn within a repeat (the order rotating), each prompt starts
with a serial so no cache serves it, and the ratio to llama-server is paired per prompt.

    .venv/bin/python bench/prefill_chunk.py [--chunks 128,256,512,1024] [--repeats 3]

Writes bench/results/prefill_chunk.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ember_runtime.contract.config import DEFAULT_CHUNK_TOKENS

from bench.machine import steal_seconds
from bench.paired import median, spread
from bench.runtime_bench import RESULTS, Server, cpu_lock, cpu_model, git_commit
from bench.speculative_bench import CONTEXT, PROMPTS_OF, SLOTS, ember_with, llama_server
from tests.support.model import default_model_path

SHAPES = ["code-edit", "rag", "summary"]
PEER = "llama-server"


def ember(model: Path, threads: int, chunk: int) -> Server:
    """Ember at its defaults but for the chunk (speculation does not touch a 1-token reply)."""
    engine = {"chunkTokens": chunk}
    return ember_with(f"ember chunk {chunk}", model, threads, engine, f"chunk-{chunk}")


def first_token_s(server: Server, prompt: str) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    began = time.perf_counter()
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - began, int(r.json()["usage"]["prompt_tokens"])


def run(servers: list[Server], repeats: int, per_shape: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for rep in range(repeats):
        with cpu_lock("/tmp/ember-cpu.lock"):
            for shape in SHAPES:
                prompts = PROMPTS_OF[shape]
                order = servers[rep % len(servers) :] + servers[: rep % len(servers)]
                for i in range(per_shape):
                    prompt = f"Request c{rep}.{i}. {prompts[i % len(prompts)]}"
                    for s in order:
                        seconds, tokens = first_token_s(s, prompt)
                        rows.append(
                            {
                                "server": s.name,
                                "shape": shape,
                                "repeat": rep,
                                "prompt": i,
                                "prompt_tokens": tokens,
                                "seconds": seconds,
                            }
                        )
    return rows


def ratios(rows: list[dict[str, Any]], name: str, shape: str) -> list[float]:
    """name / llama-server for each prompt of each repeat."""

    def times(server: str) -> dict[tuple[int, int], float]:
        return {
            (r["repeat"], r["prompt"]): r["seconds"]
            for r in rows
            if r["server"] == server and r["shape"] == shape
        }

    mine, peer = times(name), times(PEER)
    return [mine[k] / peer[k] for k in sorted(mine) if k in peer]


def report(summary: dict[str, Any]) -> str:
    rows, names = summary["rows"], summary["servers"]
    b, a = summary["load_average"]["before"], summary["load_average"]["after"]
    lines = [
        f"`python bench/prefill_chunk.py --chunks {summary['chunks']} --repeats "
        f"{summary['repeats']}` (2 threads, 2 CPUs: {summary['cpu']}; {SLOTS} slots of "
        f"{CONTEXT} cells; lone requests, max_tokens 1, greedy; load average before "
        f"{b[0]:.2f}/{b[1]:.2f}/{b[2]:.2f}, after {a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f}; "
        f"{summary['steal_s']:.1f} CPU-seconds stolen; wall {summary['wall_s'] / 60:.0f} min; "
        f"commit {summary['commit']})",
        "",
        "Time to the first token in seconds: median (min-max) over every prompt of every "
        "repeat; the ratio to llama-server is paired per prompt. Ember's default chunk is "
        f"{DEFAULT_CHUNK_TOKENS}.",
        "",
        "| server | "
        + " | ".join(f"{s} (s)" for s in SHAPES)
        + " | "
        + " | ".join(f"{s} / {PEER}" for s in SHAPES)
        + " |",
        "|---|" + "---:|" * (2 * len(SHAPES)),
    ]
    for name in names:
        cells = [
            spread(
                [r["seconds"] for r in rows if r["server"] == name and r["shape"] == s], "{:.3f}"
            )
            for s in SHAPES
        ]
        cells += [spread(ratios(rows, name, s)) if name != PEER else "1" for s in SHAPES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tokens = {s: median([r["prompt_tokens"] for r in rows if r["shape"] == s]) for s in SHAPES}
    lines += ["", "Prompt tokens (median): " + ", ".join(f"{s} {t:.0f}" for s, t in tokens.items())]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary["servers"] if n != PEER]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        mids = [median(ratios(summary["rows"], name, s)) for s in SHAPES]
        ax.bar([x + i * width for x in range(len(SHAPES))], mids, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(SHAPES))], SHAPES)
    ax.set_ylabel(f"time to first token / {PEER}'s (lower is better)")
    ax.set_title("A lone long prompt by Ember's per-sequence chunk (Gemma 3 270M, 2 threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-shape", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = default_model_path()
    chunks = [int(c) for c in args.chunks.split(",")]
    servers = [ember(model, args.threads, c) for c in chunks]
    servers.append(llama_server(model, args.threads, None))
    began, load_before, steal_before = time.monotonic(), os.getloadavg(), steal_seconds()
    for s in servers:
        s.start(RESULTS)
    try:
        rows = run(servers, args.repeats, args.per_shape)
    finally:
        for s in servers:
            s.stop()
    summary = {
        "chunks": args.chunks,
        "repeats": args.repeats,
        "cpu": cpu_model(),
        "servers": [s.name for s in servers],
        "rows": rows,
        "commit": git_commit(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "steal_s": steal_seconds() - steal_before,
        "wall_s": time.monotonic() - began,
    }
    (RESULTS / "prefill_chunk.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "prefill_chunk.md").write_text(report(summary))
    plot(summary, RESULTS / "prefill_chunk.png")
    print(report(summary))


if __name__ == "__main__":
    main()
