"""One user at the speed of the hardware (issue 48): Ember with speculative decoding from the
request's own text against llama-server with and without its own n-gram speculation, on the
workloads an edge box serves one to four people: distinct chat, a code edit (a 60-120-line file
given back with a small change), a RAG answer over a ~1,500-token context, and a summary
(bench/workloads.py), each greedy, sampled (temperature 0.8, top_p 0.95) and with no sampling
field at all.

Servers (same model, threads, 4 slots of 2,048 cells each):
- `ember`: the runtime at its defaults (speculation auto);
- `ember (speculation off)` with `--ablation`: `engine.speculation.mode: off` (what drafting
  adds);
- `llama-server`: `-np 4 -c 8192 -kvu --swa-full`, no speculation (its default);
- `llama-server --spec-type X`: the same with its n-gram speculation (`--peer-spec`, default
  ngram-simple), at its own defaults.
The peer at its best is, per goal and row, whichever llama-server configuration is better.

Levels of 1 and 4 concurrent streaming clients (`--clients`); each request carries a serial at
its start, so no prompt is served from a cache of an earlier request. Repeats are interleaved
(every server once per level per repeat, the order rotating) and each repeat holds the bench
lock; ratios are paired within a repeat and judged on their median (bench/paired.py). Raw
single-stream `llama_decode` is measured around Ember's one-client chat level of each repeat.

    .venv/bin/python bench/speculative_bench.py [--clients 1,4] [--repeats 3]

Writes bench/results/speculative.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import steal_seconds
from bench.paired import median, paired_ratios, spread
from bench.runtime_bench import (
    PROMPTS,
    RESULTS,
    SAMPLED_WITH,
    SAMPLING,
    LevelResult,
    RequestStats,
    Server,
    _level_result,
    cpu_lock,
    cpu_model,
    git_commit,
    one_request,
    raw_decode_speed,
)
from bench.workloads import CODE_EDIT, RAG, SUMMARY
from images.llama_build import ensure_llama_server
from tests.support.net import free_port

CONTEXT = 2048  # per sequence: the RAG prompt is ~1,540 tokens
SLOTS = 4
PROMPTS_OF = {"chat": PROMPTS, "code-edit": CODE_EDIT, "rag": RAG, "summary": SUMMARY}
MAX_TOKENS = {"chat": 64, "code-edit": 128, "rag": 96, "summary": 64}
# llama-server's n-gram speculation types, each at its own defaults. ngram-simple was the faster
# in a one-repeat trial on code edit and RAG (ngram-map-k: 15.4 against 40.5 decode tok/s on
# RAG); `--peer-spec ngram-simple,ngram-map-k` runs both.
PEER_SPECS = ["ngram-simple"]
# Sampling modes: runtime_bench's three (what users send), and one opt-in mode that sends
# llama-server's own filters explicitly, so both servers sample one distribution: "sampled"
# differs by the top_k 40 and min_p 0.05 that llama-server adds, which change what is drawn
# and so how long a reply runs before its end token (RAG sampled at 1 client, full run:
# Ember's replies ran 197-288 tokens of 288, llama-server's all 288; with a 1,540-token
# prompt, a shorter reply is fewer tokens per second of the same prefill).
MODES: dict[str, dict[str, object]] = {
    **SAMPLING,
    "sampled-filtered": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05},
}
FILTERED = "temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (all sent)"
SAMPLED_AS = {
    server: {**modes, "sampled-filtered": FILTERED} for server, modes in SAMPLED_WITH.items()
}
# `--ember-sampling llama-server`: Ember's deployment defaults (`spec.sampling`) set to
# llama-server's, so the same body samples one distribution on both servers in every mode.
LLAMA_DEFAULTS = {"temperature": 0.8, "topP": 0.95, "topK": 40, "minP": 0.05}
EMBER_SAMPLING: dict[str, dict[str, float | int]] = {"openai": {}, "llama-server": LLAMA_DEFAULTS}
SAMPLED_AS_CONFIGURED = {
    "greedy": "temperature 0 (argmax)",
    "sampled": "temperature 0.8, top_p 0.95 (sent), top_k 40, min_p 0.05 (spec.sampling)",
    "client-defaults": "spec.sampling: temperature 0.8, top_p 0.95, top_k 40, min_p 0.05",
    "sampled-filtered": FILTERED,
}


def sampled_as(server: str, mode: str, ember_sampling: str) -> str:
    """What `server` samples in `mode`, given Ember's `--ember-sampling`."""
    if server == "ember" and ember_sampling == "llama-server":
        return SAMPLED_AS_CONFIGURED[mode]
    return SAMPLED_AS[server][mode]


@dataclass
class Row(LevelResult):
    """runtime_bench's level result, and the one-stream decode rate beside it."""

    decode_tok_s: float = 0.0  # median over requests of tokens after the first / their time


def body(workload: str, index: int, serial: str) -> dict[str, object]:
    shape, _, mode = workload.partition("/")
    prompts = PROMPTS_OF[shape]
    return {
        "prompt": f"Request {serial}.{index}. {prompts[index % len(prompts)]}",
        "max_tokens": MAX_TOKENS[shape],
        **MODES[mode],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_level(
    server: Server, workload: str, clients: int, repeat: int, per_client: int | None = None
) -> Row:
    """Each of `clients` sends `per_client` requests back to back (default 3 alone, else 2)."""
    if per_client is None:
        per_client = 3 if clients == 1 else 2
    stats: list[RequestStats] = []
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=server.base, timeout=900) as client:
        await asyncio.gather(*(client.get("/v1/models") for _ in range(clients)))
        began = time.perf_counter()

        async def worker(c: int) -> None:
            for turn in range(per_client):
                serial = f"{repeat}.{clients}.{workload}"
                try:
                    path = "/v1/completions"
                    stat = await one_request(
                        client, path, body(workload, c + turn * clients, serial)
                    )
                    stat.turn = turn
                    stats.append(stat)
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - began
    level = _level_result(server, workload, clients, wall, (stats, failures))
    decode = [(s.tokens - 1) / sum(s.gaps) for s in stats if s.gaps and sum(s.gaps) > 0]
    fields = {**asdict(level), "repeat": repeat}
    return Row(**fields, decode_tok_s=statistics.median(decode) if decode else 0.0)


def ember(name: str, model: Path, threads: int, speculation: str, sampling: str) -> Server:
    engine = {"speculation": {"mode": speculation}}
    tag = f"speculation-{speculation}-{sampling}"
    return ember_with(name, model, threads, engine, tag, sampling=EMBER_SAMPLING[sampling])


def ember_with(
    name: str,
    model: Path,
    threads: int,
    engine: dict[str, Any],
    tag: str,
    *,
    sampling: dict[str, float | int] | None = None,
) -> Server:
    """The runtime at its defaults but for `engine` (its runtime config's engine block) and
    `sampling` (its deployment sampling defaults), on the bench's slots and context; `tag`
    names its config file."""
    port = free_port()
    config = RESULTS / f"ember-bench-config-{tag}.yaml"
    data = {"modelName": model.stem, "modelDir": str(model.parent), "engine": engine}
    config.write_text(json.dumps({**data, "sampling": sampling or {}}))
    argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(config)]
    argv += ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--threads", str(threads), "--max-batch-size", str(SLOTS)]
    argv += ["--context-length", str(CONTEXT), "--max-queue", "64", "--log-level", "warning"]
    return Server(name, argv, port)


def llama_server(model: Path, threads: int, spec_type: str | None) -> Server:
    port = free_port()
    t = str(threads)
    argv = [str(ensure_llama_server()), "-m", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", t, "-tb", t, "-np", str(SLOTS)]
    argv += ["-c", str(CONTEXT * SLOTS), "-kvu", "--swa-full", "--log-disable"]
    name = "llama-server"
    if spec_type:
        argv += ["--spec-type", spec_type]
        name += f" --spec-type {spec_type}"
    return Server(name, argv, port)


def servers(
    model: Path, threads: int, peer_specs: list[str], ablation: bool, sampling: str
) -> list[Server]:
    off = [ember("ember (speculation off)", model, threads, "off", sampling)] if ablation else []
    return [
        ember("ember", model, threads, "auto", sampling),
        *off,
        llama_server(model, threads, None),
        *(llama_server(model, threads, s) for s in peer_specs),
    ]


Key = tuple[str, str, int]


def by_key(rows: list[Row]) -> dict[Key, dict[int, Row]]:
    out: dict[Key, dict[int, Row]] = {}
    for r in rows:
        out.setdefault((r.server, r.workload, r.clients), {})[r.repeat] = r
    return out


def ratio(
    keyed: dict[Key, dict[int, Row]], ours: Key, peers: list[str], attr: str, higher: bool
) -> tuple[str, list[float]] | None:
    """Ember / the peer configuration at its best for `attr` (by median), paired per repeat."""
    _, workload, clients = ours
    names = [p for p in peers if (p, workload, clients) in keyed]
    if ours not in keyed or not names:
        return None

    def score(name: str) -> float:
        value = median([getattr(r, attr) for r in keyed[(name, workload, clients)].values()])
        return value if higher else -value

    best = max(names, key=score)
    mine = {k: getattr(r, attr) for k, r in keyed[ours].items()}
    theirs = {k: getattr(r, attr) for k, r in keyed[(best, workload, clients)].items()}
    return best, paired_ratios(mine, theirs)


def judged(label: str, found: tuple[str, list[float]] | None, op: str, bound: float) -> str:
    if found is None:
        return f"{label}: not measured"
    peer, ratios = found
    ok = median(ratios) >= bound if op == ">=" else median(ratios) <= bound
    every = ratios and all((r >= bound) if op == ">=" else (r <= bound) for r in ratios)
    verdict = ("met" + (", in every repeat" if every else "")) if ok else "missed"
    return f"{label} vs {peer}: {spread(ratios)}x (goal {op} {bound}: {verdict})"


def verdicts(rows: list[Row], raw: dict[int, float]) -> list[str]:
    keyed = by_key(rows)
    peers = sorted({r.server for r in rows if r.server.startswith("llama-server")})
    spec_peers = [p for p in peers if "--spec-type" in p]
    notes = []
    single = keyed.get(("ember", "chat/greedy", 1))
    if single and raw:
        decode = {k: r.decode_tok_s for k, r in single.items()}
        notes.append(
            judged(
                "1 client, chat: Ember decode / raw llama_decode",
                ("raw", paired_ratios(decode, raw)),
                ">=",
                0.95,
            )
        )
    for workload in dict.fromkeys(r.workload for r in rows):
        for clients in sorted({r.clients for r in rows}):
            key = ("ember", workload, clients)
            head = f"{workload}, {clients} client(s)"
            speed = ratio(keyed, key, peers, "tok_s", True)
            notes.append(judged(f"{head}: tok/s", speed, ">=", 1.0) + lengths(keyed, key, speed))
            notes.append(
                judged(f"{head}: TTFT p99", ratio(keyed, key, peers, "ttft_p99", False), "<=", 1.0)
            )
            shape = workload.partition("/")[0]
            if clients == 1 and shape in ("code-edit", "rag"):
                plain = ratio(keyed, key, ["llama-server"], "tok_s", True)
                notes.append(judged(f"{head}: tok/s, peer at its defaults", plain, ">=", 1.5))
                spec = ratio(keyed, key, spec_peers, "tok_s", True)
                notes.append(judged(f"{head}: tok/s, peer's speculation on", spec, ">=", 1.1))
            off = keyed.get(("ember (speculation off)", workload, clients))
            if off and key in keyed:
                gain = paired_ratios(
                    {k: r.tok_s for k, r in keyed[key].items()},
                    {k: r.tok_s for k, r in off.items()},
                )
                notes.append(f"{head}: speculation gives Ember {spread(gain)}x its tok/s without")
            if clients == 4 and key in keyed:
                jitter = [r.itl_p99 / r.itl_p50 for r in keyed[key].values() if r.itl_p50]
                ok = "met" if jitter and median(jitter) < 2 else "missed"
                notes.append(f"{head}: Ember ITL p99 / p50 {spread(jitter)} (goal < 2: {ok})")
    return notes


def lengths(
    keyed: dict[Key, dict[int, Row]], ours: Key, found: tuple[str, list[float]] | None
) -> str:
    """A note where Ember's replies and the peer's differ in length by more than 5 %: tok/s
    then spreads the same prompt's prefill over a different number of tokens."""
    if found is None or ours not in keyed:
        return ""
    peer = (found[0], *ours[1:])
    mine = median([r.tokens for r in keyed[ours].values()])
    theirs = median([r.tokens for r in keyed.get(peer, {}).values()])
    if not theirs or abs(mine / theirs - 1) <= 0.05:
        return ""
    return f" (replies of different length: Ember {mine:.0f} tokens, the peer {theirs:.0f})"


def table(rows: list[Row]) -> str:
    lines = [
        "| server | workload | clients | requests x repeats | tokens | tok/s | decode tok/s "
        "| TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (server, workload, clients), reps in by_key(rows).items():
        rs = list(reps.values())

        def cell(attr: str, fmt: str, scale: float = 1.0, rs: list[Row] = rs) -> str:
            return spread([getattr(r, attr) * scale for r in rs], fmt)

        lines.append(
            f"| {server} | {workload} | {clients} | {rs[0].requests} x {len(rs)} "
            f"| {cell('tokens', '{:.0f}')} | {cell('tok_s', '{:.1f}')} "
            f"| {cell('decode_tok_s', '{:.1f}')} "
            f"| {cell('ttft_p50', '{:.3f}')} | {cell('ttft_p99', '{:.3f}')} "
            f"| {cell('itl_p50', '{:.1f}', 1e3)} | {cell('itl_p99', '{:.1f}', 1e3)} "
            f"| {sum(r.errors for r in rs)} |"
        )
    return "\n".join(lines)


def report(summary: dict[str, Any]) -> str:
    rows = [Row(**r) for r in summary["results"]]
    configured = summary.get("ember_sampling", "openai")
    raw = {int(k): sum(v) / len(v) for k, v in summary["raw_decode_around"].items() if v}
    b, a = summary["load_average"]["before"], summary["load_average"]["after"]
    return "\n".join(
        [
            f"`{summary['command']}` ({summary['threads']} threads, {summary['cpus']} CPUs: "
            f"{summary['cpu']}; {SLOTS} slots of {CONTEXT} cells for every server; "
            f"{summary['repeats']} repeats, interleaved; load average before "
            f"{'/'.join(f'{x:.2f}' for x in b)}, after {'/'.join(f'{x:.2f}' for x in a)}; "
            f"{summary['cpu_stolen_s']:.1f} CPU-seconds stolen; wall "
            f"{summary['wall_s'] / 60:.0f} min; commit {summary['commit']})"
            + (f". **{summary['stopped']}**" if summary.get("stopped") else ""),
            "",
            "Cells: median (min-max) over repeats. Ratios are paired within a repeat; a goal is "
            "judged on their median. Max tokens: "
            + ", ".join(f"{k} {v}" for k, v in MAX_TOKENS.items())
            + ". Sampling (the same body to every server): "
            + "; ".join(
                f"{m}: Ember {sampled_as('ember', m, configured)}, llama-server "
                f"{sampled_as('llama-server', m, configured)}"
                for m in dict.fromkeys(r.workload.partition("/")[2] for r in rows)
            ),
            "",
            table(rows),
            "",
            "Raw single-stream llama_decode around Ember's one-client chat level, per repeat: "
            + (
                "; ".join(f"{k}: {v:.1f} tok/s" for k, v in sorted(raw.items()))
                or "not measured (it brackets chat/greedy at 1 client, not in this run)"
            ),
            "",
            *(f"- {n}" for n in verdicts(rows, raw)),
        ]
    )


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keyed = by_key(rows)
    workloads = list(dict.fromkeys(r.workload for r in rows))
    names = list(dict.fromkeys(r.server for r in rows))
    levels = sorted({r.clients for r in rows})
    fig, axes = plt.subplots(
        len(levels), 1, figsize=(max(10, len(workloads) * 1.3), 4 * len(levels)), squeeze=False
    )
    width = 0.8 / len(names)
    for row, clients in enumerate(levels):
        ax = axes[row][0]
        for i, name in enumerate(names):
            mids = [
                median([r.tok_s for r in keyed.get((name, w, clients), {}).values()] or [0.0])
                for w in workloads
            ]
            ax.bar([x + i * width for x in range(len(workloads))], mids, width, label=name)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(workloads))],
            workloads,
            rotation=30,
            ha="right",
            fontsize=8,
        )
        ax.set(ylabel="output tok/s (median)", title=f"{clients} client(s)")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Gemma 3 270M Q4_K_M, 2 threads: speculative decoding from the request's text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="chat,code-edit,rag,summary")
    p.add_argument("--sampling", default=",".join(SAMPLING), help=f"of {', '.join(MODES)}")
    p.add_argument("--peer-spec", default=",".join(PEER_SPECS))
    p.add_argument("--ablation", action="store_true", help="also Ember with speculation off")
    p.add_argument(
        "--ember-sampling",
        choices=sorted(EMBER_SAMPLING),
        default="openai",
        help="Ember's spec.sampling: none (OpenAI's defaults) or llama-server's defaults",
    )
    p.add_argument("--lock", default="/tmp/ember-cpu.lock")
    p.add_argument("--name", default="speculative")
    p.add_argument("--replot", type=Path)
    p.add_argument("--per-client", type=int, help="requests per client (3 alone, else 2)")
    args = p.parse_args()
    if args.replot:
        return write(json.loads(args.replot.read_text()), args.name)
    from tests.support.model import default_model_path

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = default_model_path()
    workloads = [f"{w}/{m}" for w in args.workloads.split(",") for m in args.sampling.split(",")]
    levels = [int(c) for c in args.clients.split(",")]
    began, load_before, steal_before = time.monotonic(), os.getloadavg(), steal_seconds()
    started: list[Server] = []
    rows: list[Row] = []
    bracket: dict[int, list[float]] = {}
    stopped = ""
    try:
        specs = [s for s in args.peer_spec.split(",") if s]
        for server in servers(model, args.threads, specs, args.ablation, args.ember_sampling):
            server.start(RESULTS)
            started.append(server)
        step = 0
        for repeat in range(1, args.repeats + 1):
            with cpu_lock(args.lock):
                for clients in levels:
                    for workload in workloads:
                        for server in started[step:] + started[:step]:
                            near = (server.name, workload, clients) == ("ember", "chat/greedy", 1)
                            if near:
                                bracket.setdefault(repeat, []).append(
                                    raw_decode_speed(model, args.threads, 64, repack=True)
                                )
                            level = run_level(server, workload, clients, repeat, args.per_client)
                            row = asyncio.run(level)
                            if near:
                                bracket[repeat].append(
                                    raw_decode_speed(model, args.threads, 64, repack=True)
                                )
                            print(json.dumps(asdict(row)), flush=True)
                            rows.append(row)
                        step = (step + 1) % len(started)
    except (SystemExit, KeyboardInterrupt) as exc:  # SIGTERM or ^C: keep the rows measured
        stopped = f"stopped early ({type(exc).__name__}) after {len(rows)} rows"
    finally:
        for server in started:
            server.stop()
    write(
        {
            "command": "python bench/speculative_bench.py " + " ".join(sys.argv[1:]),
            "stopped": stopped,
            "commit": git_commit(),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "repeats": args.repeats,
            "ember_sampling": args.ember_sampling,
            "raw_decode_around": bracket,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "cpu_stolen_s": steal_seconds() - steal_before,
            "wall_s": time.monotonic() - began,
            "results": [asdict(r) for r in rows],
        },
        args.name,
    )


def write(summary: dict[str, Any], name: str) -> None:
    text = report(summary)
    print(text)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2))
    plot([Row(**r) for r in summary["results"]], RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
