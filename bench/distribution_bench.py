"""Model distribution to a site over a thin WAN: every node from the origin vs Ember's sharing.

    .venv/bin/python -m bench.distribution_bench [--model PATH] [--nodes 4] [--out bench/results]

Needs root (network namespaces) and the local control plane (`tests/cluster`, started here if
it is not running). Real network hops, real API server, real agents:

- A LAN: a bridge in the host namespace, one network namespace per "node" on a veth pair
  (10.201.0.0/24); the API server is reached through it (the host's HOST_IP).
- A WAN: the origin in its own namespace on another veth pair (10.202.0.0/24), routed by the
  host, shaped with `tc tbf` at `--wan-mbit` (20 Mbit/s) in both directions. This machine's
  kernel has no `sch_netem` ("Specified qdisc kind is unknown"), so the `--wan-delay-ms`
  (40 ms) delay is added in the origin's namespace by a small TCP proxy in front of the
  origin that holds every chunk of the response direction for that long before sending it
  on (what netem on the origin's egress would do; at most 4 MiB in flight). The origin is
  tests/nodeagent/origin.py (it honours Range and counts every body byte it sends).
- Each node runs the real agent (`python -m ember_runtime.nodeagent`) inside its namespace,
  with a token bound to a pod on its own Node object (the chart's RBAC and admission policies
  apply), peer port 7431 on its namespace's address.

Scenarios, in one run, each on fresh Node objects, caches and origin counters:
1. `alone`: one node fetches the model from the origin (the reference time).
2. `every-node-origin`: all nodes fetch from the origin at once (no sharing).
3. `ember-site-sharing`: all nodes with site sharing: one origin download under the site's
   Lease, the others from the holder over the LAN.
The clock starts when the pods' fetch annotation is written (the agents already watch) and
stops when a node's cache holds the verified file. Goals: origin bytes <= 1.05x one copy and
all nodes done within 1.3x `alone`.

Writes `distribution.{json,md,png}` under `--out`. SIGTERM/SIGINT tear the namespaces down.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from kubernetes import client, config

from tests.cluster.cluster import Cluster
from tests.cluster.control_plane import HOST_IP
from tests.conftest import Kube
from tests.nodeagent.site_support import SiteWorld
from tests.support.model import MODEL_FILENAME, MODEL_SHA256, default_model_path, sha256_file
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
BRIDGE = "embr0"
LAN = "10.201.0"
WAN = "10.202.0"
ORIGIN_NS = "emb-origin"
ORIGIN_PORT = 8080
PEER_PORT = 7431


def ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    subprocess.run(argv, check=True, capture_output=True)


def node_ns(i: int) -> str:
    return f"emb-n{i}"


def node_ip(i: int) -> str:
    return f"{LAN}.{11 + i}"


def teardown(nodes: int) -> None:
    for ns in [ORIGIN_NS, *(node_ns(i) for i in range(nodes))]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    for dev in [BRIDGE, "embo-h", *(f"embn{i}-h" for i in range(nodes))]:
        subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)


def setup(nodes: int, wan_mbit: int) -> None:
    teardown(nodes)
    ip("ip", "link", "add", BRIDGE, "type", "bridge")
    ip("ip", "addr", "add", f"{LAN}.1/24", "dev", BRIDGE)
    ip("ip", "link", "set", BRIDGE, "up")
    for i in range(nodes):
        ns, host_end = node_ns(i), f"embn{i}-h"
        ip("ip", "netns", "add", ns)
        ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("ip", "link", "set", host_end, "master", BRIDGE, "up")
        ip("ip", "addr", "add", f"{node_ip(i)}/24", "dev", "eth0", ns=ns)
        ip("ip", "link", "set", "eth0", "up", ns=ns)
        ip("ip", "link", "set", "lo", "up", ns=ns)
        ip("ip", "route", "add", "default", "via", f"{LAN}.1", ns=ns)
    ip("ip", "netns", "add", ORIGIN_NS)
    ip("ip", "link", "add", "embo-h", "type", "veth", "peer", "name", "eth0", "netns", ORIGIN_NS)
    ip("ip", "addr", "add", f"{WAN}.1/24", "dev", "embo-h")
    ip("ip", "link", "set", "embo-h", "up")
    ip("ip", "addr", "add", f"{WAN}.2/24", "dev", "eth0", ns=ORIGIN_NS)
    ip("ip", "link", "set", "eth0", "up", ns=ORIGIN_NS)
    ip("ip", "link", "set", "lo", "up", ns=ORIGIN_NS)
    ip("ip", "route", "add", "default", "via", f"{WAN}.1", ns=ORIGIN_NS)
    tbf = ["tbf", "rate", f"{wan_mbit}mbit", "burst", "64kb", "latency", "400ms"]
    ip("tc", "qdisc", "add", "dev", "eth0", "root", *tbf, ns=ORIGIN_NS)  # origin -> site
    ip("tc", "qdisc", "add", "dev", "embo-h", "root", *tbf)  # site -> origin


@contextmanager
def origin(model: Path, stats: Path, delay_ms: int) -> Iterator[str]:
    """The Range-honouring origin in its namespace; yields the model's URL."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}/runtime:{ROOT}"}
    argv = ["ip", "netns", "exec", ORIGIN_NS, sys.executable, "-m", "bench.distribution_bench"]
    argv += ["--serve-origin", str(model), "--stats", str(stats)]
    argv += ["--wan-delay-ms", str(delay_ms)]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    url = f"http://{WAN}.2:{ORIGIN_PORT}/{MODEL_FILENAME}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the origin exited ({proc.returncode}) before it was ready")
        return stats.with_suffix(".ready").exists()

    try:
        wait_for("the origin to start", ready, 60, 0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk held `delay` seconds after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

    async def read() -> None:
        while chunk := await reader.read(64 << 10):
            await queue.put((time.monotonic() + delay, chunk))
        await queue.put((0.0, b""))

    reading = asyncio.create_task(read())
    try:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(chunk)
            await writer.drain()
    finally:
        reading.cancel()
        with suppress(Exception):
            writer.close()


async def _delay_proxy(listen_port: int, upstream_port: int, delay: float) -> None:
    """0.0.0.0:listen_port -> 127.0.0.1:upstream_port, the response direction delayed."""

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        u_reader, u_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(
            _pump(c_reader, u_writer, 0.0),
            _pump(u_reader, c_writer, delay),
            return_exceptions=True,
        )

    server = await asyncio.start_server(handle, "0.0.0.0", listen_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def serve_origin(model: Path, stats: Path, delay_ms: int) -> int:
    """The origin process: serve `model` behind the delaying proxy until SIGTERM, then write
    what the origin sent."""
    from tests.nodeagent.origin import serve

    with serve({MODEL_FILENAME: model.read_bytes()}, "127.0.0.1") as (base, state):
        upstream = int(base.rsplit(":", 1)[1])
        ready = stats.with_suffix(".ready")
        asyncio.run(_start_and_run(ready, ORIGIN_PORT, upstream, delay_ms / 1000))
        sent = {"bytes_sent": state.bytes_sent, "requests": len(state.requests)}
    stats.write_text(json.dumps(sent))
    return 0


async def _start_and_run(ready: Path, port: int, upstream: int, delay: float) -> None:
    task = asyncio.create_task(_delay_proxy(port, upstream, delay))
    await asyncio.sleep(0.5)  # listening by now (a failed bind ends the task: checked here)
    if task.done():
        task.result()
    ready.touch()
    await task


def scenario(
    kube: Kube,
    model: Path,
    sha: str,
    name: str,
    nodes: int,
    *,
    sharing: bool,
    work: Path,
    delay_ms: int,
) -> dict[str, Any]:
    size = model.stat().st_size
    namespace = f"dist-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    world = SiteWorld(kube, namespace, work / name)
    world.tmp.mkdir(parents=True)
    port = str(kube.api.configuration.host).rsplit(":", 1)[1]
    load_before = os.getloadavg()
    try:
        world.install()
        world.add_nodes([node_ip(i) for i in range(nodes)])
        world.want(None)
        stats = world.tmp / "origin.json"
        with origin(model, stats, delay_ms) as url:
            world.start(
                f"https://{HOST_IP}:{port}",
                prefix=lambda i: ["ip", "netns", "exec", node_ns(i)],
                peer_bind="0.0.0.0",  # the node's own namespace
                peer_port=PEER_PORT,
                sharing=sharing,
                extra=["--lease_seconds=15"],
            )
            world.wait(
                lambda: all("keeping models" in a.log.read_text() for a in world.agents),
                60,
                "the agents to start",
            )
            time.sleep(2)  # their pod watches are open (listed, then watching)
            started = time.monotonic()
            world.announce([{"url": url, "sha256": sha, "sizeBytes": size}])
            done: dict[str, float] = {}  # node -> seconds until its copy was whole

            def all_cached() -> bool:
                for a in world.agents:
                    if a.node not in done and a.cache.has(sha, size):
                        done[a.node] = time.monotonic() - started
                return len(done) >= nodes

            world.wait(all_cached, 1800, f"{name}: every node's copy")
            world.stop_agents()
        sent = json.loads(stats.read_text())
        origin_lines = [a.node for a in world.agents if "from the origin in" in a.log.read_text()]
    finally:
        world.close()
        with suppress(Exception):
            kube.core.delete_namespace(namespace)
    times = sorted(done.values())
    print(f"{name}: all {nodes} in {times[-1]:.1f}s, origin {sent['bytes_sent'] / size:.2f}x")
    return {
        "name": name,
        "nodes": nodes,
        "sharing": sharing,
        "node_done_s": [round(t, 2) for t in times],
        "all_done_s": round(times[-1], 2),
        "origin_bytes": sent["bytes_sent"],
        "origin_requests": sent["requests"],
        "origin_copies": round(sent["bytes_sent"] / size, 4),
        "fetched_from_origin_by": origin_lines,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "distribution.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = {r["name"]: r for r in result["scenarios"]}
    alone = rows["alone"]["all_done_s"]
    lines = [
        "# Model distribution to one site over a thin WAN",
        "",
        f"{result['date']} · model {result['model']} ({result['size_bytes']:,} bytes) · "
        f"{result['nodes']} nodes · WAN {result['wan_mbit']} Mbit/s + {result['wan_delay_ms']} "
        "ms (tc tbf; the delay by a proxy at the origin: no netem in this kernel), LAN a "
        "bridge · real API server, real agents (`python -m bench.distribution_bench`)",
        "",
        "| scenario | nodes | all done (s) | vs one node alone | per node (s) | origin bytes "
        "| origin copies | load avg (1 min, after) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["scenarios"]:
        per = ", ".join(f"{t:.1f}" for t in r["node_done_s"])
        lines.append(
            f"| {r['name']} | {r['nodes']} | {r['all_done_s']:.1f} | "
            f"{r['all_done_s'] / alone:.2f}x | {per} | {r['origin_bytes']:,} | "
            f"{r['origin_copies']:.3f} | {r['loadavg_after'][0]:.2f} |"
        )
    sharing = rows["ember-site-sharing"]
    goals = result["goals"]
    lines += [
        "",
        f"Goals (site sharing): origin bytes <= 1.05x one copy: **{sharing['origin_copies']:.3f}x"
        f"** ({'met' if goals['origin_bytes_met'] else 'NOT met'}); all nodes within 1.3x one "
        f"node alone: **{sharing['all_done_s'] / alone:.2f}x** "
        f"({'met' if goals['time_met'] else 'NOT met'}).",
        "",
        f"The origin download was made by {', '.join(sharing['fetched_from_origin_by'])} "
        "(the site's Lease holder); the others fetched from it over the LAN once it held the "
        "verified file. The machine has 2 cores and was shared; load averages are in the JSON.",
    ]
    (out / "distribution.md").write_text("\n".join(lines) + "\n")
    plot(out / "distribution.png", result)


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = result["scenarios"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(scen):
        left.scatter([i] * len(r["node_done_s"]), r["node_done_s"], color="C0", zorder=3)
        left.bar(i, r["all_done_s"], color="C0", alpha=0.3)
    alone = scen[0]["all_done_s"]
    left.axhline(1.3 * alone, color="C3", ls="--", label="goal: 1.3x one node alone")
    left.set_xticks(range(len(scen)), [r["name"] for r in scen], fontsize=8)
    left.set_ylabel("seconds until the node holds the model")
    left.legend(fontsize=8)
    right.bar(range(len(scen)), [r["origin_copies"] for r in scen], color="C1")
    right.axhline(1.05, color="C3", ls="--", label="goal: 1.05 copies")
    right.set_xticks(range(len(scen)), [r["name"] for r in scen], fontsize=8)
    right.set_ylabel("origin (WAN) bytes, in copies of the model")
    right.legend(fontsize=8)
    fig.suptitle(
        f"{result['nodes']} nodes, WAN {result['wan_mbit']} Mbit/s + {result['wan_delay_ms']} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the packaged Gemma")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--wan-mbit", type=int, default=20)
    parser.add_argument("--wan-delay-ms", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ember-distribution"))
    parser.add_argument("--serve-origin", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_origin is not None:
        return serve_origin(args.serve_origin, args.stats, args.wan_delay_ms)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    model = args.model or default_model_path()
    sha = MODEL_SHA256 if args.model is None else sha256_file(model)
    cluster = Cluster()
    cluster.up(with_node=False)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    kube = Kube(cluster=cluster, kubeconfig=cluster.kubeconfig, api=api)
    work = args.work / dt.datetime.now(dt.UTC).strftime("%H%M%S")
    setup(args.nodes, args.wan_mbit)
    delay = args.wan_delay_ms
    try:
        scenarios = [
            scenario(kube, model, sha, "alone", 1, sharing=False, work=work, delay_ms=delay),
            scenario(
                kube,
                model,
                sha,
                "every-node-origin",
                args.nodes,
                sharing=False,
                work=work,
                delay_ms=delay,
            ),
            scenario(
                kube,
                model,
                sha,
                "ember-site-sharing",
                args.nodes,
                sharing=True,
                work=work,
                delay_ms=delay,
            ),
        ]
    finally:
        teardown(args.nodes)
    size = model.stat().st_size
    sharing = scenarios[2]
    result = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model.name,
        "size_bytes": size,
        "nodes": args.nodes,
        "wan_mbit": args.wan_mbit,
        "wan_delay_ms": args.wan_delay_ms,
        "scenarios": scenarios,
        "goals": {
            "origin_bytes_met": sharing["origin_copies"] <= 1.05,
            "time_met": sharing["all_done_s"] <= 1.3 * scenarios[0]["all_done_s"],
        },
    }
    write_results(args.out, result)
    print((args.out / "distribution.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
