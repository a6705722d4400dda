"""Replica choice under open-loop load: kube-proxy, round robin, least outstanding, the gateway.

Three runtime processes (`python -m ember_runtime.server`: the real engine on the real Gemma 3
270M GGUF) each read their temperature from their own fake sysfs thermal tree; one gateway
process (`python -m ember_runtime.gateway --static`) routes to all three. Two workloads:

* `hot`: distinct completion prompts; replica 0's zone is raised to `HOT_CELSIUS`, so its own
  governor (the real sensor path) lowers its batch limit to `HOT_BATCH`, and the gateway's
  probes see it throttled;
* `shared`: chat requests whose system prompt is one of `len(SYSTEMS)` long ones (more than a
  replica's batch of cached prefixes, so where a prompt lands matters); every replica cool.

Per workload the bench first measures the three replicas' capacity (closed loop: as many
clients on each replica as its batch limit, all three at once; completed requests per second),
then offers `--fraction` of it as Poisson arrivals, the same arrival times and prompts for
every policy of a repeat, policies interleaved (a different order each repeat):

* `kube-proxy`: `--connections` keep-alive client connections, each pinned at connect to a
  replica drawn at random (what iptables/IPVS kube-proxy does per connection); each arrival
  goes out on a random connection;
* `round-robin`: replica i mod 3 per request;
* `least-outstanding`: the replica with the fewest of the bench's requests in flight (ties at
  random);
* `gateway`: every request to the gateway.

The three baselines choose in the bench's own client (no proxy process: they pay no hop);
nothing is retried on the client. Goodput counts the tokens of requests that met the SLO
(TTFT ≤ `--slo-ttft`, time per output token ≤ `--slo-tpot`) per second from the first arrival
to the last completion. Each non-2xx status and transport error a client saw is counted;
retries are the gateway's own counter (`ember_gateway_retries_total`) over the run.

Every comparison is a ratio paired by repeat (bench/paired.py): gateway / baseline of one
metric within each repeat, the median of those ratios, and their min-max. The JSON keeps every
repeat's row per policy, each replica's measured capacity, and the ratios derived from them.

    flock /tmp/ember-cpu.lock .venv/bin/python bench/gateway_bench.py [--threads 4]
        [--repeats 3] [--duration 12] [--workloads hot,shared] [--previous JSON] [--smoke]
    .venv/bin/python bench/gateway_bench.py --replot bench/results/gateway_bench.json

Writes `bench/results/gateway_bench.{md,json,png}` (`--out` another folder); `--previous` keeps
an earlier run's results of the workloads this one does not run; `--replot` runs nothing and
writes a JSON's md and png (and its derived ratios and goals) again beside it. The defaults are
sized for 16 cores (`bench/gateway_bench_device.sh` runs it on the device machine's CPUs, where
the committed results ran; docs/gateway.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from ember_runtime.contract.thermal import ThermalPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_overhead import start
from bench.machine import steal_seconds
from bench.paired import median, paired_ratios
from bench.paired import spread as spread_text
from bench.runtime_bench import PROMPTS, QUESTIONS, SYSTEM, cpu_model, one_request, pct
from tests.support.model import default_model_path
from tests.support.net import free_port
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.runtime_proc import RuntimeProcess, start_runtime

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "gemma3-270m"  # tests/thermal/runtime_proc.py's served model name
POLICIES = ("kube-proxy", "round-robin", "least-outstanding", "gateway")
WORKLOADS = ("hot", "shared")
COOL_CELSIUS = 45.0
HOT_CELSIUS = 88.0
HOT_BATCH = 2  # the governor's floor: 88 °C is 10 steps of 1 °C above the 78 °C threshold
THERMAL = ThermalPolicy(min_batch_size=HOT_BATCH, celsius_per_step=1.0)
MAX_TOKENS = 32
_TEAMS = ("Aster", "Birch", "Cedar", "Dune", "Elm", "Fjord", "Glen", "Heath", "Iris", "Juniper")
# Long system prompts (~500 tokens each) that differ from their first words: neither the
# gateway's prefix hash nor a replica's prefix cache can take one for another.
SYSTEMS = [
    f"Team {team} operations desk, rulebook {k + 1}. {SYSTEM} In short, again: {SYSTEM}"
    for k, team in enumerate(_TEAMS)
]
GOAL_HOT_P99 = 0.5  # gateway TTFT p99 / round robin's, one replica hot
GOAL_SHARED_P50 = 0.7  # gateway TTFT p50 / round robin's, shared system prompts
BASELINES = POLICIES[:-1]
COMPARED = ("goodput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s")
RATIO_METHOD = (
    "gateway / baseline, paired by repeat: a metric's ratio within each repeat (every policy "
    "of a repeat ran the same arrival times and prompts, in turns), then the median of those "
    "ratios; the range is their min-max (bench/paired.py)"
)
WORKLOAD_ARGS = ("duration", "fraction", "capacity_seconds", "repeats", "threads", "capacity")


def request_body(workload: str, seed: str, serial: str, index: int) -> tuple[str, dict[str, Any]]:
    """Request `index` of a run. `seed` (the repeat's) picks the system prompt, alike for every
    policy; `serial` (the run's) starts the text that is the request's own, so no run finds
    another run's prompt in a replica's cache."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    common |= {"stream": True, "stream_options": {"include_usage": True}}
    if workload == "hot":
        prompt = f"Story {serial}.{index}. {PROMPTS[index % len(PROMPTS)]}"
        return "/v1/completions", {"prompt": prompt, **common}
    system = random.Random(f"{seed}.{index}").choice(SYSTEMS)
    messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"Ticket {serial}.{index}. {QUESTIONS[index % len(QUESTIONS)]}",
        },
    ]
    return "/v1/chat/completions", {"messages": messages, **common}


@dataclass
class Outcome:
    """One request as its client saw it."""

    sent: float
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    done: float = 0.0
    error: str = ""  # "429", "503", "ReadTimeout", ...; empty when it completed


@dataclass
class Site:
    replicas: list[RuntimeProcess]
    trees: list[FakeThermalTree]
    gateway: str

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


async def send(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Outcome:
    out = Outcome(sent=time.perf_counter())
    try:
        stats = await one_request(client, url + path, body)
    except httpx.HTTPStatusError as exc:
        out.error = str(exc.response.status_code)
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    else:
        out.ttft, out.gaps, out.tokens = stats.ttft, stats.gaps, stats.tokens
    out.done = time.perf_counter()
    return out


Picker = Callable[[], int]


def picker(
    policy: str, replicas: int, connections: int, rng: random.Random, busy: list[int]
) -> Picker:
    """A baseline's choice of replica (index) for the next request."""
    if policy == "kube-proxy":
        pinned = [rng.randrange(replicas) for _ in range(connections)]
        return lambda: pinned[rng.randrange(connections)]
    if policy == "round-robin":
        turn = iter(range(10**9))
        return lambda: next(turn) % replicas
    if policy == "least-outstanding":
        return lambda: min(range(replicas), key=lambda i: (busy[i], rng.random()))
    raise ValueError(f"no client-side choice for {policy!r}")


async def open_loop(
    site: Site, policy: str, workload: str, *, rate: float, seed: str, args: argparse.Namespace
) -> list[Outcome]:
    """Poisson arrivals at `rate` per second for `args.duration` seconds (the same times for
    every policy of a repeat: `seed`); waits for every request."""
    arrivals = random.Random(seed)
    rng = random.Random(f"{seed}/{policy}")
    busy = [0] * len(site.urls)
    pick = None if policy == "gateway" else picker(policy, len(busy), args.connections, rng, busy)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def one(index: int) -> Outcome:
            path, body = request_body(workload, seed, f"{seed}.{policy}", index)
            if pick is None:
                return await send(client, site.gateway, path, body)
            chosen = pick()
            busy[chosen] += 1
            try:
                return await send(client, site.urls[chosen], path, body)
            finally:
                busy[chosen] -= 1

        tasks: list[asyncio.Task[Outcome]] = []
        start_at, due = time.perf_counter(), 0.0
        while (due := due + arrivals.expovariate(rate)) < args.duration:
            await asyncio.sleep(max(0.0, start_at + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(len(tasks))))
        return list(await asyncio.gather(*tasks))


async def closed_loop(url: str, clients: int, workload: str, seconds: float, serial: str) -> float:
    """Requests per second one replica completes with `clients` back-to-back clients that start
    requests for `seconds`; the requests still running then are waited for and counted (a
    request can take longer than the window at small sizes)."""
    began = time.perf_counter()
    stop_at, done = began + seconds, 0
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker(w: int) -> None:
            nonlocal done
            turn = 0
            while time.perf_counter() < stop_at:
                # each worker its own draw of system prompts: the same mix as the open loop's
                path, body = request_body(workload, f"{serial}.{w}", f"{serial}.{w}", turn)
                outcome = await send(client, url, path, body)
                done += not outcome.error  # after the await: `done += await ...` loses updates
                turn += 1

        await asyncio.gather(*(worker(w) for w in range(clients)))
    return done / (time.perf_counter() - began)


def batch_limits(site: Site) -> list[int]:
    return [int(httpx.get(f"{u}/admin/state", timeout=5).json()["maxBatchSize"]) for u in site.urls]


def set_heat(site: Site, hot: bool, capacity: int) -> None:
    """Replica 0's zone hot or cool; returns once every governor has applied it and the gateway's
    probes have seen it (its /metrics is not per-replica state, so wait two probe rounds)."""
    site.trees[0].set(0, HOT_CELSIUS if hot else COOL_CELSIUS)
    want = [HOT_BATCH if hot else capacity] + [capacity] * (len(site.urls) - 1)
    deadline = time.monotonic() + 30
    while batch_limits(site) != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch limits {batch_limits(site)}, expected {want}")
        time.sleep(0.2)
    time.sleep(1.0)  # the gateway probes every 0.4 s


def measure_capacity(site: Site, workload: str, seconds: float) -> list[float]:
    """Each replica's completed requests per second, all three loaded at once (replica 0
    first)."""
    limits = batch_limits(site)

    async def all_three() -> list[float]:
        jobs = [
            closed_loop(url, n, workload, seconds, f"cap.{i}")
            for i, (url, n) in enumerate(zip(site.urls, limits, strict=True))
        ]
        return list(await asyncio.gather(*jobs))

    done = asyncio.run(all_three())
    rates = ", ".join(f"{r:.2f}" for r in done)
    print(f"capacity[{workload}]: batch limits {limits}, requests/s {rates}", flush=True)
    if not sum(done):
        raise RuntimeError(f"no request completed while measuring capacity ({workload})")
    return done


def gateway_counters(url: str) -> dict[str, float]:
    """The gateway's retries (all causes) and its attempts per replica (its address), from its
    /metrics."""
    counts: dict[str, float] = {"retries": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("ember_gateway_retries_total{"):
            counts["retries"] += float(value)
        elif line.startswith("ember_gateway_replica_requests_total{"):
            replica = line.partition('replica="')[2].partition('"')[0]
            counts[replica] = counts.get(replica, 0.0) + float(value)
    return counts


def summarise(outcomes: list[Outcome], args: argparse.Namespace) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    good = [
        o
        for o in ok
        if o.ttft <= args.slo_ttft
        and (o.done - o.sent - o.ttft) / max(1, o.tokens - 1) <= args.slo_tpot
    ]
    span = max(o.done for o in outcomes) - min(o.sent for o in outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    ttfts, gaps = [o.ttft for o in ok], [g for o in ok for g in o.gaps]
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "slo_met": len(good),
        "goodput_tok_s": sum(o.tokens for o in good) / span,
        "throughput_tok_s": sum(o.tokens for o in ok) / span,
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "itl_p99_s": pct(gaps, 0.99),
        "errors": errors,
    }


def run_policy(
    site: Site, policy: str, workload: str, *, rate: float, seed: str, args: argparse.Namespace
) -> dict[str, Any]:
    before = gateway_counters(site.gateway)
    outcomes = asyncio.run(open_loop(site, policy, workload, rate=rate, seed=seed, args=args))
    row = summarise(outcomes, args)
    after = gateway_counters(site.gateway)
    row["retries"] = after["retries"] - before["retries"]
    # where the gateway sent its attempts, replica 0 (the hot one in `hot`) first
    row["gateway_attempts"] = [after.get(u, 0.0) - before.get(u, 0.0) for u in site.urls]
    print(
        f"  {workload:6} {policy:17} n={row['requests']:3} goodput {row['goodput_tok_s']:6.1f} "
        f"TTFT p50 {row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f} "
        f"ITL p99 {row['itl_p99_s']:.3f} errors {row['errors']} retries {row['retries']:.0f}",
        flush=True,
    )
    return row


def run_workload(
    site: Site, workload: str, capacity: int, args: argparse.Namespace
) -> dict[str, Any]:
    set_heat(site, workload == "hot", capacity)
    load, steal = os.getloadavg(), steal_seconds()
    per_replica = measure_capacity(site, workload, args.capacity_seconds)
    rate = args.fraction * sum(per_replica)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        order = POLICIES[rep % len(POLICIES) :] + POLICIES[: rep % len(POLICIES)]
        for policy in order:
            runs[policy].append(
                run_policy(site, policy, workload, rate=rate, seed=f"{workload}{rep}", args=args)
            )
            time.sleep(args.settle)
    return {
        "capacity_req_s": sum(per_replica),
        "capacity_per_replica_req_s": per_replica,
        "offered_req_s": rate,
        "batch_limits": batch_limits(site),
        # this workload's own (a --previous file's workloads come from other invocations)
        "args": {k: getattr(args, k) for k in WORKLOAD_ARGS},
        "runs": runs,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": [load[0], os.getloadavg()[0]],
        "steal_seconds": steal_seconds() - steal,
    }


def start_site(args: argparse.Namespace, work: Path) -> tuple[Site, Any]:
    """Three replicas (one fake thermal tree each) and the gateway over them; the gateway's
    process is returned beside the site, to stop it."""
    trees, replicas = [], []
    for i in range(3):
        tree = FakeThermalTree(work / f"sys{i}")
        tree.zone(0, "cpu-thermal", COOL_CELSIUS)
        (work / f"r{i}").mkdir()
        replicas.append(
            start_runtime(
                work / f"r{i}",
                tree.root,
                max_batch=args.capacity,
                min_batch=HOT_BATCH,
                context=args.context,
                threads=args.threads,
                thermal=THERMAL,
                max_queue=args.max_queue,
                model=args.model,
            )
        )
        trees.append(tree)
    routes = work / "routes.json"
    routes.write_text(
        json.dumps({"models": [{"name": MODEL, "replicas": [r.url for r in replicas]}]})
    )
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "ember_runtime.gateway",
        "--static",
        str(routes),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    url = f"http://127.0.0.1:{port}"
    return Site(replicas, trees, url), start(argv, f"{url}/readyz", work / "gateway.log")


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max (nan where there is none)."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": median(values), "min": min(values), "max": max(values)}


def paired(runs: dict[str, list[dict[str, Any]]], peer: str, metric: str) -> dict[str, Any]:
    """The gateway against `peer` on one metric, paired by repeat (RATIO_METHOD)."""
    ratios = paired_ratios(
        {i: r[metric] for i, r in enumerate(runs["gateway"])},
        {i: r[metric] for i, r in enumerate(runs[peer])},
    )
    return {"ratios": ratios, **spread(ratios)}


def comparisons(workloads: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload, baseline and metric: the gateway's paired ratios to that baseline."""
    return {
        workload: {
            peer: {metric: paired(w["runs"], peer, metric) for metric in COMPARED}
            for peer in BASELINES
        }
        for workload, w in workloads.items()
    }


def refusals(workloads: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per workload and policy: the 429s and 503s its clients saw, over every repeat."""
    return {
        workload: {
            policy: sum(
                n for run in runs for code, n in run["errors"].items() if code in ("429", "503")
            )
            for policy, runs in w["runs"].items()
        }
        for workload, w in workloads.items()
    }


def goals(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its paired ratios (gateway / round robin by repeat); the refusals goal
    with every policy's count beside the gateway's."""
    compared, out = comparisons(workloads), []
    for workload, metric, goal in (
        ("hot", "ttft_p99_s", GOAL_HOT_P99),
        ("shared", "ttft_p50_s", GOAL_SHARED_P50),
    ):
        if workload in compared:
            c = compared[workload]["round-robin"][metric]
            text = f"{workload}: gateway {metric} ≤ {goal}× round robin's"
            out.append({"goal": text, **c, "met": c["median"] <= goal})
    refused = refusals(workloads)
    per_policy = {p: sum(r.get(p, 0) for r in refused.values()) for p in POLICIES}
    out.append(
        {
            "goal": "no client-visible 429/503 through the gateway (capacity suffices)",
            "refused": per_policy,
            "met": per_policy["gateway"] == 0,
        }
    )
    return out


def derive(out: dict[str, Any]) -> dict[str, Any]:
    """What the report reads besides the measurements, from the measurements alone (so
    `--replot` re-derives it from a JSON)."""
    workloads = out["workloads"]
    return out | {
        "ratio_method": RATIO_METHOD,
        "comparisons": comparisons(workloads),
        "refusals": refusals(workloads),
        "goals": goals(workloads),
    }


def _cell(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> str:
    return spread_text([r[key] * scale for r in runs], "{:.0f}")


def _errors(runs: list[dict[str, Any]]) -> str:
    total: dict[str, int] = {}
    for run in runs:
        for code, n in run["errors"].items():
            total[code] = total.get(code, 0) + n
    return ", ".join(f"{n}× {code}" for code, n in sorted(total.items())) or "none"


def _header(out: dict[str, Any]) -> list[str]:
    a = out["args"]
    return [
        "# Replica choice under open-loop load (bench/gateway_bench.py)",
        "",
        f"{out['date']}, {out['cpus']} CPUs ({out['cpu_model']}); load average before "
        f"{out['loadavg_before'][0]:.2f}, after {out['loadavg_after'][0]:.2f}; steal over the run "
        f"{out['steal_seconds']:.1f} s. {out['where']}",
        f"Three runtimes ({out['model']}, {a['threads']} threads, batch {a['capacity']}, "
        f"queue {a['max_queue']}, context {a['context']}), one gateway process; load: Poisson "
        f"arrivals at {a['fraction']:.0%} of the measured capacity for {a['duration']:.0f} s "
        f"(this invocation's arguments: --workloads {a['workloads']}), {a['repeats']} repeats, "
        f"{MAX_TOKENS} tokens per request (ignore_eos). Baselines choose in the bench's client "
        f"(no proxy hop); kube-proxy: {a['connections']} connections pinned at random. SLO: TTFT "
        f"≤ {a['slo_ttft']} s and time per output token ≤ {a['slo_tpot']} s. Cells: median "
        "(min-max) over repeats; errors and retries summed over repeats. Ratios: "
        f"{out['ratio_method']}.",
    ]


def _arguments(out: dict[str, Any], workload: str, w: dict[str, Any]) -> str:
    if "args" in w:
        a = w["args"]
        return (
            f"Its arguments: {a['duration']:.0f} s of arrivals at {a['fraction']:.0%}, "
            f"{a['repeats']} repeats, capacity measured for {a['capacity_seconds']:.0f} s."
        )
    if workload in out["args"]["workloads"].split(","):
        return "Its arguments: the header's."
    return "Its arguments: an earlier invocation's (kept with --previous), not recorded."


def _capacity(w: dict[str, Any]) -> str:
    per = w.get("capacity_per_replica_req_s")
    if per is None:
        return "per replica: not recorded (the run predates it)"
    return "per replica (replica 0 first): " + ", ".join(f"{r:.2f}" for r in per) + " req/s"


def _workload(out: dict[str, Any], workload: str, w: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## {workload}: capacity {w['capacity_req_s']:.2f} req/s (batch limits "
        f"{w['batch_limits']}; {_capacity(w)}), offered {w['offered_req_s']:.2f} req/s",
        "",
        f"Finished {w['date']}; load average {w['loadavg'][0]:.2f} before, "
        f"{w['loadavg'][1]:.2f} after; steal {w['steal_seconds']:.1f} s. "
        + _arguments(out, workload, w),
        "",
        "| policy | goodput tok/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | non-2xx / errors "
        "| retries |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, runs in w["runs"].items():
        lines.append(
            f"| {policy} | {_cell(runs, 'goodput_tok_s')} | {_cell(runs, 'ttft_p50_s', 1e3)} "
            f"| {_cell(runs, 'ttft_p99_s', 1e3)} | {_cell(runs, 'itl_p99_s', 1e3)} "
            f"| {_errors(runs)} | {sum(r['retries'] for r in runs):.0f} |"
        )
    per_run = [r["gateway_attempts"] for r in w["runs"]["gateway"]]
    attempts = [f"{sum(col):.0f}" for col in zip(*per_run, strict=True)]
    lines += ["", f"The gateway's attempts per replica (replica 0 first): {attempts}.", ""]
    lines += ["| gateway / | " + " | ".join(COMPARED) + " |", "|---" * (len(COMPARED) + 1) + "|"]
    for peer, metrics in out["comparisons"][workload].items():
        cells = [spread_text(metrics[m]["ratios"]) for m in COMPARED]
        lines.append(f"| {peer} | " + " | ".join(cells) + " |")
    refused = ", ".join(f"{p} {n}" for p, n in out["refusals"][workload].items())
    return [*lines, "", f"429/503 seen by clients, all repeats: {refused}."]


def _goal(g: dict[str, Any]) -> str:
    verdict = "**met**" if g["met"] else "**missed**"
    if "refused" in g:
        counts = ", ".join(f"{p} {n}" for p, n in g["refused"].items())
        return f"- {g['goal']}: {verdict} (429/503 seen by clients, all workloads: {counts})"
    ratios = ", ".join(f"{r:.2f}" for r in g["ratios"])
    return f"- {g['goal']}: {verdict}, paired ratio {g['median']:.2f} (per repeat {ratios})"


def render(out: dict[str, Any]) -> str:
    lines = _header(out)
    for workload, w in out["workloads"].items():
        lines += _workload(out, workload, w)
    lines += ["", "## Goals", "", *(_goal(g) for g in out["goals"])]
    return "\n".join(lines) + "\n"


def _bars(ax: Any, groups: list[str], series: dict[str, list[dict[str, float]]]) -> None:
    """Grouped bars, median with min-max whiskers, one series per key."""
    width = 0.8 / len(series)
    for k, (label, cells) in enumerate(series.items()):
        meds = [c["median"] for c in cells]
        err = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
        xs = [i + k * width for i in range(len(groups))]
        ax.bar(xs, meds, width, yerr=err, capsize=3, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax.legend(fontsize=8)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    fig, axes = plt.subplots(len(names), 3, figsize=(16, 3.6 * len(names)), squeeze=False)
    for row, workload in enumerate(names):
        runs = out["workloads"][workload]["runs"]
        for col, keys in enumerate((("ttft_p50_s", "ttft_p99_s"), ("goodput_tok_s",))):
            series = {k: [spread([r[k] for r in runs[p]]) for p in POLICIES] for k in keys}
            _bars(axes[row][col], list(POLICIES), series)
            axes[row][col].set_title(f"{workload}: {', '.join(keys)} (median, min-max)")
        ratios = out["comparisons"][workload]
        series = {m: [ratios[p][m] for p in BASELINES] for m in COMPARED}
        ax = axes[row][2]
        _bars(ax, list(BASELINES), series)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{workload}: gateway / baseline, paired by repeat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=4, help="engine threads per replica")
    ap.add_argument("--capacity", type=int, default=8, help="max batch of a cool replica")
    ap.add_argument("--max-queue", type=int, default=8, help="a replica's queue before 429")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--fraction", type=float, default=0.7, help="offered load / capacity")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per run")
    ap.add_argument("--capacity-seconds", type=float, default=15.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--connections", type=int, default=12, help="kube-proxy's client connections")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="seconds per output token")
    ap.add_argument("--timeout", type=float, default=120.0, help="a client's request timeout")
    ap.add_argument("--settle", type=float, default=1.0, help="idle seconds between runs")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the packaged one)")
    ap.add_argument("--where", default="", help="a sentence on where it ran, for the report")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--previous", type=Path, help="keep this JSON's other workloads' results")
    ap.add_argument("--smoke", action="store_true", help="tiny: 1 thread, 1 repeat, 4 s runs")
    ap.add_argument(
        "--replot", type=Path, help="run nothing: this JSON's md, png and ratios afresh, beside it"
    )
    args = ap.parse_args()
    if args.smoke:
        args.threads, args.capacity, args.repeats = 1, 4, 1
        args.duration, args.capacity_seconds, args.settle = 4.0, 4.0, 0.5
        args.fraction, args.slo_ttft, args.slo_tpot = 0.5, 5.0, 1.0
    return args


def report(out: dict[str, Any], folder: Path, stem: str) -> None:
    """`stem`.{json,md,png} in `folder`, the derived parts computed afresh."""
    out = derive(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    (folder / f"{stem}.md").write_text(render(out))
    plot(out, folder / f"{stem}.png")
    print(render(out), flush=True)


def write(args: argparse.Namespace, workloads: dict[str, Any], began: dict[str, Any]) -> None:
    """The results so far (after each workload: a run cut short keeps what it measured)."""
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "where": args.where,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "model": (args.model or default_model_path()).name,
        "loadavg_before": began["loadavg"],
        "loadavg_after": os.getloadavg(),
        "steal_seconds": steal_seconds() - began["steal"],
        "workloads": workloads,
    }
    report(out, args.out, "gateway_bench_smoke" if args.smoke else "gateway_bench")


def main() -> None:
    args = parse_args()
    if args.replot:  # the measurements as they are; the report, ratios and goals afresh
        report(json.loads(args.replot.read_text()), args.replot.parent, args.replot.stem)
        return
    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    began = {"loadavg": os.getloadavg(), "steal": steal_seconds()}
    site, gateway = start_site(args, work)
    workloads: dict[str, Any] = {}
    if args.previous:  # an earlier run's workloads that this one does not run again
        workloads = json.loads(args.previous.read_text())["workloads"]
    try:
        for workload in args.workloads.split(","):
            workloads[workload] = run_workload(site, workload, args.capacity, args)
            write(args, workloads, began)
    finally:
        gateway.terminate()
        gateway.wait(30)
        for replica in site.replicas:
            replica.stop()


if __name__ == "__main__":
    main()
