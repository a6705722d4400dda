"""Many models on a small box (issue 47): `bench/results/density.{md,json,png}`, one section per
run, each run replacing its own section of the JSON and redrawing the rest.

    .venv/bin/python bench/density_bench.py coldstart [--repeats 3]    # the local real cluster
    .venv/bin/python bench/density_bench.py swap [--requests 60]       # the local real cluster
    .venv/bin/python bench/density_bench.py adapters [--repeats 3] [--requests 24]

`coldstart` and `swap` run on the local cluster with the chart and its site gateway
(bench/density_cluster.py says how). `adapters` needs no cluster:

Section `adapters` (this file; no cluster): eight rank-8 LoRA adapters of Gemma 3 270M, written
by `tests/support/lora.py` (random weights, fixed seeds: a tenant's fine-tunes of one base).
Both servers load the base once with all eight: Ember from `engine.adapters`, each served under
its own model name; llama-server with `--lora` ×8 and `--lora-init-without-apply`, a request
choosing its adapter with `"lora": [{"id": k, "scale": 1}]` (the only per-request selection it
has). The same streaming completions go to both (the runtime bench's distinct prompts, greedy
and sampled at 0.8/0.95), from 8 concurrent clients, in three request mixes:
* `none`: every request on the base;
* `one`: every request on adapter 0;
* `mixed`: request i on adapter i mod 8 (eight tenants at once).
Reported: output tok/s and TTFT p50/p99 per server and mix, with repeats interleaved (median,
min-max; goals on the median of paired ratios), each server's peak RSS with its eight adapters
against one base-only Ember (eight separate models would hold eight of those), and greedy parity:
each adapter's 32-token greedy completion of one prompt from both servers.

Where the engine does not share batches: llama.cpp applies adapters per context
(`llama_set_adapter_lora`), so one `llama_decode` serves one adapter set. Ember splits each step
into one call per adapter in use (`engines/scheduler.split_by_adapter`); the base's weights and
KV cache stay shared. llama-server does not batch requests whose adapter sets differ either: a
slot with other adapters waits for the next round.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import density_cluster
from bench.machine import steal_seconds
from bench.paired import paired_ratios, spread
from bench.runtime_bench import (
    CTX_PER_SEQ,
    PROMPTS,
    RESULTS,
    SAMPLING,
    Server,
    cpu_lock,
    cpu_model,
    ember,
    git_commit,
    llama_server,
    one_request,
    pct,
)
from tests.support.lora import write_lora
from tests.support.model import default_model_path, sha256_file

ADAPTERS = 8
CLIENTS = 8
MAX_TOKENS = 64
PARITY_TOKENS = 32
PARITY_PROMPT = "The three most important things to check on a water pump are"
MIXES = ("none", "one", "mixed")
SECTIONS = ("coldstart", "swap", "adapters")
MODES = ("greedy", "sampled")
EMBER, PEER = "ember", "llama-server --lora"


@dataclass
class Row:
    server: str
    mix: str
    mode: str
    repeat: int
    requests: int
    errors: int
    tok_s: float
    ttft_p50: float
    ttft_p99: float


def adapter_files(model: Path, out: Path) -> list[tuple[str, Path, str]]:
    """(name, file, sha256) of the eight adapters, seeds 1-8."""
    made = []
    for k in range(ADAPTERS):
        path = write_lora(model, out / f"tenant-{k}.gguf", seed=k + 1)
        made.append((f"tenant-{k}", path, sha256_file(path)))
    return made


def servers(model: Path, threads: int, adapters: list[tuple[str, Path, str]]) -> list[Server]:
    entries = [{"name": n, "path": str(p), "sha256": s} for n, p, s in adapters]
    ours = ember(EMBER, model, threads)
    config = adapters[0][1].parent / "ember-adapters.json"  # JSON is YAML
    engine = {"adapters": entries}
    config.write_text(
        json.dumps({"modelName": model.stem, "modelDir": str(model.parent), "engine": engine})
    )
    ours.argv[ours.argv.index("--config") + 1] = str(config)
    peer = llama_server(model, threads)
    peer.name = PEER
    for _, path, _ in adapters:
        peer.argv += ["--lora", str(path)]
    peer.argv += ["--lora-init-without-apply"]
    base = ember("ember (base only)", model, threads)
    return [ours, peer, base]


def body_for(server: str, mix: str, mode: str, index: int, serial: str) -> dict[str, Any]:
    """A streaming completion; its adapter by model name (Ember) or lora id (llama-server)."""
    adapter = None if mix == "none" else 0 if mix == "one" else index % ADAPTERS
    body: dict[str, Any] = {
        "prompt": f"Story {serial}. {PROMPTS[index % len(PROMPTS)]}",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING[mode],
    }
    if server == EMBER:
        body["model"] = f"tenant-{adapter}" if adapter is not None else default_model_path().stem
    elif adapter is not None:
        body["lora"] = [{"id": adapter, "scale": 1.0}]
    return body


async def run_mix(server: Server, mix: str, mode: str, requests: int, serial: str) -> Row:
    per_client = max(1, requests // CLIENTS)
    stats, errors = [], 0
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        await asyncio.gather(*(client.get("/v1/models") for _ in range(CLIENTS)))
        began = time.perf_counter()

        async def worker(c: int) -> None:
            nonlocal errors
            for turn in range(per_client):
                i = c + turn * CLIENTS
                body = body_for(server.name, mix, mode, i, f"{serial}.{i}")
                try:
                    stats.append(await one_request(client, "/v1/completions", body))
                except httpx.HTTPError:
                    errors += 1

        await asyncio.gather(*(worker(c) for c in range(CLIENTS)))
        wall = time.perf_counter() - began
    ttfts = [s.ttft for s in stats]
    tokens = sum(s.tokens for s in stats)
    return Row(
        server.name, mix, mode, 0, len(stats), errors, tokens / wall, pct(ttfts, 0.5),
        pct(ttfts, 0.99),
    )  # fmt: skip


def parity(ours: Server, peer: Server) -> list[dict[str, Any]]:
    """Each adapter's greedy 32-token completion of one prompt from both servers."""
    out = []
    for k in range(ADAPTERS):
        common = {"prompt": PARITY_PROMPT, "max_tokens": PARITY_TOKENS, "temperature": 0}
        a = httpx.post(
            ours.base + "/v1/completions", json={**common, "model": f"tenant-{k}"}, timeout=120
        ).json()["choices"][0]["text"]
        b = httpx.post(
            peer.base + "/v1/completions",
            json={**common, "lora": [{"id": k, "scale": 1.0}]},
            timeout=120,
        ).json()["choices"][0]["text"]
        out.append({"adapter": f"tenant-{k}", "ember": a, "llamaServer": b, "equal": a == b})
    return out


def measure(
    started: list[Server], repeats: int, requests: int, lock: str
) -> tuple[list[Row], float]:
    rows: list[Row] = []
    steal = 0.0
    for repeat in range(repeats):
        with cpu_lock(lock):
            before = steal_seconds()
            for mode in MODES:
                for mix in MIXES:
                    for server in started[:2]:
                        row = asyncio.run(
                            run_mix(server, mix, mode, requests, f"{repeat}.{mode}.{mix}")
                        )
                        row.repeat = repeat
                        rows.append(row)
                        print(json.dumps(asdict(row)), flush=True)
            steal += steal_seconds() - before
    return rows, steal


def cell(rows: list[Row], attr: str) -> str:
    values = [getattr(r, attr) for r in rows]
    fmt: Callable[[float], str] = (lambda v: f"{v:.1f}") if attr == "tok_s" else (
        lambda v: f"{v:.3f}"
    )  # fmt: skip
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def verdicts(rows: list[Row]) -> list[str]:
    lines = []
    for mode in MODES:
        for mix in MIXES:
            ours = [r for r in rows if (r.server, r.mix, r.mode) == (EMBER, mix, mode)]
            theirs = [r for r in rows if (r.server, r.mix, r.mode) == (PEER, mix, mode)]
            ratios = paired_ratios(
                {r.repeat: r.tok_s for r in ours}, {r.repeat: r.tok_s for r in theirs}
            )
            lines.append(f"- {mode}, {mix}: Ember / llama-server tok/s = {spread(ratios)}×")
    return lines


def report_adapters(summary: dict[str, Any]) -> list[str]:
    rows = [Row(**r) for r in summary["rows"]]
    out = [
        "## Adapters: eight LoRA adapters on one base",
        "",
        f"`{summary['command']}` at commit {summary['commit']}; {summary['cpu']}, "
        f"{summary['threads']} threads, {CLIENTS} streaming clients, {MAX_TOKENS} tokens out, "
        f"{summary['repeats']} repeats interleaved; load average before {summary['load']}, "
        f"steal {summary['steal']:.1f} s over the measured spans.",
        "",
        "| mode | mix | server | tok/s | TTFT p50 s | TTFT p99 s | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        for mix in MIXES:
            for server in (EMBER, PEER):
                sel = [r for r in rows if (r.server, r.mix, r.mode) == (server, mix, mode)]
                errors = sum(r.errors for r in sel)
                out.append(
                    f"| {mode} | {mix} | {server} | {cell(sel, 'tok_s')} | "
                    f"{cell(sel, 'ttft_p50')} | {cell(sel, 'ttft_p99')} | {errors} |"
                )
    out += ["", "Ember / llama-server tok/s, median of paired repeats (range):", ""]
    out += [*verdicts(rows), ""]
    rss = summary["peakRssBytes"]
    mib = {k: v / 2**20 for k, v in rss.items()}
    alone = rss["ember (base only)"]
    out += [
        "Memory (peak RSS of the server process):",
        "",
        f"- Ember, base + {ADAPTERS} adapters: {mib[EMBER]:.0f} MiB",
        f"- llama-server, base + {ADAPTERS} adapters: {mib[PEER]:.0f} MiB",
        f"- Ember, base only: {alone / 2**20:.0f} MiB; {ADAPTERS} separate models would hold "
        f"{ADAPTERS * alone / 2**20:.0f} MiB, {ADAPTERS * alone / rss[EMBER]:.1f}× the shared base",
        "",
        f"Greedy parity with llama-server --lora ({PARITY_TOKENS} tokens, one prompt): "
        f"{sum(p['equal'] for p in summary['parity'])} of {ADAPTERS} adapters give the same "
        "text (each pair of texts is in the JSON).",
        "",
    ]
    return out


def plot_adapters(summary: dict[str, Any], ax: Any) -> None:
    rows = [Row(**r) for r in summary["rows"]]
    labels = [f"{mode[:4]}/{mix}" for mode in MODES for mix in MIXES]
    for offset, server in enumerate((EMBER, PEER)):
        values = [
            statistics.median(
                r.tok_s for r in rows if (r.server, r.mix, r.mode) == (server, mix, mode)
            )
            for mode in MODES
            for mix in MIXES
        ]
        ax.bar([i + offset * 0.4 for i in range(len(values))], values, width=0.4, label=server)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, rotation=30, fontsize=7)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{ADAPTERS} adapters, {CLIENTS} clients")
    ax.legend(fontsize=7)


def adapters_section(args: argparse.Namespace) -> dict[str, Any]:
    model = default_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="density-"))
    made = adapter_files(model, tmp)
    load = os.getloadavg()[0]
    started: list[Server] = []
    try:
        for server in servers(model, args.threads, made):
            server.start(tmp)
            started.append(server)
        parity_rows = parity(started[0], started[1])
        rows, steal = measure(started, args.repeats, args.requests, args.lock)
    finally:
        for server in started:
            server.stop()
    return {
        "command": " ".join(["bench/density_bench.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "threads": args.threads,
        "contextPerSequence": CTX_PER_SEQ,
        "repeats": args.repeats,
        "load": round(load, 2),
        "steal": steal,
        "rows": [asdict(r) for r in rows],
        "parity": parity_rows,
        "peakRssBytes": {s.name: s.peak_rss_bytes for s in started},
    }


def report(summary: dict[str, Any]) -> str:
    out = ["# Density: many models on a small box (issue 47)", ""]
    if "coldstart" in summary:
        out += density_cluster.report_coldstart(summary["coldstart"])
    if "swap" in summary:
        out += density_cluster.report_swap(summary["swap"])
    if "adapters" in summary:
        out += report_adapters(summary["adapters"])
    missing = [s for s in SECTIONS if s not in summary]
    if missing:
        out += [f"Not run yet: {', '.join(missing)}.", ""]
    return "\n".join(out)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [s for s in SECTIONS if s in summary]
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 4), squeeze=False)
    drawers = {
        "coldstart": density_cluster.plot_coldstart,
        "swap": density_cluster.plot_swap,
        "adapters": plot_adapters,
    }
    for ax, section in zip(axes[0], present, strict=True):
        drawers[section](summary[section], ax)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("section", choices=[*SECTIONS, "report"], help="report: redraw only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=24, help="adapters: per mix; swap: in all")
    p.add_argument("--lock", default="/tmp/ember-cpu.lock")
    p.add_argument("--name", default="density")
    args = p.parse_args()
    path = RESULTS / f"{args.name}.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if args.section == "adapters":
        summary["adapters"] = adapters_section(args)
    elif args.section != "report":
        with cpu_lock(args.lock):
            result = density_cluster.main(args.section, args.repeats, args.requests)
        summary[args.section] = {**result, "command": " ".join(sys.argv), "commit": git_commit()}
    text = report(summary)
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text + "\n")
    path.write_text(json.dumps(summary, indent=2))
    plot(summary, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
