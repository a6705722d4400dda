"""Operator benchmark on the local control plane + a kwok fleet (not a test; prints a table).

    .venv/bin/python -m bench.operator_bench [--objects 1000] [--nodes 500] [--sites 5]
                                             [--steady-seconds 120] [--resync 10]

Measures, for N InferenceDeployments created at once on a fleet of fake nodes:
  * time until every object reports Ready (status.readyReplicas == spec.replicas);
  * API writes per object made by the operator during convergence (status/annotation writes on
    the InferenceDeployments seen by a watch, child applies/deletes from the operator's own
    counter, Events posted);
  * writes during a steady-state window (goal: 0);
  * the operator's peak RSS (VmHWM of its process).
Side by side, the same number of equivalent plain Deployments created directly (no operator) on
the same fleet: the floor that the scheduler, kwok and the controllers impose on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ember_operator import render, sizing
from ember_operator.api.models import parse_spec
from ember_operator.settings import OperatorSettings
from kubernetes import config
from kubernetes.client.exceptions import ApiException

from tests.cluster.cluster import Cluster
from tests.cluster.fleet import node_manifest
from tests.cluster.procs import free_port
from tests.operator import rest
from tests.operator.specs import fleet_manifest

ROOT = Path(__file__).resolve().parents[1]


def _namespace(api: Any, name: str) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    rest.request(api, "POST", "/api/v1/namespaces", body=body)


def make_fleet(api: Any, n: int, sites: int) -> None:
    """n kwok nodes over `sites` sites (tests/cluster/fleet.py's manifest), posted as plain JSON."""

    def create(i: int) -> None:
        try:
            rest.request(
                api, "POST", "/api/v1/nodes", body=node_manifest(f"fleet-{i}", f"site-{i % sites}")
            )
        except ApiException as exc:
            if exc.status != 409:  # already there: the fleet is idempotent
                raise

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(n)))


def _create_all(api: Any, kind: str, ns: str, bodies: list[dict[str, Any]]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda b: rest.create(api, kind, ns, b), bodies))


def _ready_count_infd(api: Any, ns: str) -> int:
    ready = 0
    for obj in rest.items(api, "infd", ns):
        st = obj.get("status") or {}
        if (
            st.get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("readyReplicas", 0) >= obj["spec"]["replicas"]
        ):
            ready += 1
    return ready


def _ready_count_deployments(api: Any, ns: str) -> int:
    return sum(
        1
        for d in rest.items(api, "deployments", ns)
        if (d.get("status") or {}).get("readyReplicas", 0) >= d["spec"]["replicas"]
    )


def _wait_all(count: Any, total: int, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        done = count()
        print(f"  {time.monotonic() - start:6.1f}s  {done}/{total} ready", file=sys.stderr)
        if done >= total:
            return time.monotonic() - start
        time.sleep(2.0)
    return None


class PeakRss:
    """Samples VmHWM (the kernel's own peak-RSS record) of a process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def peak_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def _operator_writes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ember_operator_api_writes_total{")
    )


def _watch_in_background(api: Any, ns: str, kinds: list[str], seconds: int) -> Any:
    result: list[str] = []

    def run() -> None:
        rest.count_writes(api, ns, kinds, seconds, sink=result)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def baseline(api: Any, ns: str, n: int, sites: list[str], timeout: float) -> float | None:
    """The same pods as plain Deployments (rendered by our renderer), no operator involved.
    The namespace is kept until the end so its clean-up does not load the operator's run."""
    _namespace(api, ns)
    settings = OperatorSettings()
    bodies = []
    for i in range(n):
        doc = fleet_manifest(f"p{i}", sites)
        spec = parse_spec(doc["spec"])
        owner = render.Owner(f"p{i}", ns, "")
        (dep,) = [
            m
            for m in render.render(owner, spec, settings, sizing.compute(spec, settings, None))
            if m["kind"] == "Deployment"
        ]
        del dep["metadata"]["ownerReferences"]
        bodies.append(dep)
    start = time.monotonic()
    _create_all(api, "deployments", ns, bodies)
    done = _wait_all(lambda: _ready_count_deployments(api, ns), n, timeout)
    return None if done is None else time.monotonic() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster()
    cluster.up(with_node=False)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferencedeployments.ember.dev")
    t0 = time.monotonic()
    make_fleet(api, args.nodes, args.sites)
    fleet_s = time.monotonic() - t0
    sites = [f"site-{i}" for i in range(args.sites)]
    print(f"fleet of {args.nodes} nodes in {fleet_s:.1f}s", file=sys.stderr)
    print("baseline: plain Deployments", file=sys.stderr)
    plain_ns = f"bench-plain-{os.getpid()}"
    plain = baseline(api, plain_ns, args.objects, sites, args.timeout) if args.baseline else None
    print("operator: InferenceDeployments", file=sys.stderr)

    ns = f"bench-{os.getpid()}"
    _namespace(api, ns)
    metrics_port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "EMBER_OPERATOR_RESYNC_SECONDS": str(args.resync),
        "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}",
    }
    cmd = [
        sys.executable,
        "-m",
        "ember_operator",
        "--standalone",
        "-n",
        ns,
        "--metrics-port",
        str(metrics_port),
        "--liveness-port",
        "0",
    ]
    log = (ROOT / "bench" / "results").resolve()
    log.mkdir(parents=True, exist_ok=True)
    with (log / "operator_bench.log").open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        rss = PeakRss(proc.pid)
        time.sleep(3)
        watcher, infd_events = _watch_in_background(api, ns, ["infd", "events"], int(args.timeout))
        bodies = [fleet_manifest(f"m{i}", sites) for i in range(args.objects)]
        start = time.monotonic()
        _create_all(api, "infd", ns, bodies)
        created_s = time.monotonic() - start
        done = _wait_all(lambda: _ready_count_infd(api, ns), args.objects, args.timeout)
        converge_s = None if done is None else time.monotonic() - start
        child_writes = _operator_writes(metrics_port)
        print(f"steady state: watching for {args.steady_seconds}s", file=sys.stderr)
        time.sleep(2)
        # The watch ends at its own timeout; count what it saw so far (copy under the GIL).
        seen = list(infd_events)
        operator_events = [e for e in seen if not e.startswith("ADDED infd/")]
        steady = rest.count_writes(
            api,
            ns,
            ["infd", "deployments", "services", "configmaps", "pdbs", "events"],
            args.steady_seconds,
        )
        steady_child = _operator_writes(metrics_port) - child_writes
        del watcher
        return {
            "objects": args.objects,
            "nodes": args.nodes,
            "sites": args.sites,
            "fleet_setup_s": round(fleet_s, 1),
            "create_s": round(created_s, 1),
            "converge_s": None if converge_s is None else round(converge_s, 1),
            "plain_deployments_s": None if plain is None else round(plain, 1),
            "writes_per_object": round((len(operator_events) + child_writes) / args.objects, 2),
            "child_applies_per_object": round(child_writes / args.objects, 2),
            "steady_window_s": args.steady_seconds,
            "steady_writes": len(steady) + steady_child,
            "peak_rss_mib": round(rss.peak_mib(), 1),
        }
    finally:
        proc.terminate()
        proc.wait(30)
        rest.request(api, "DELETE", f"/api/v1/namespaces/{ns}")
        if args.baseline:
            rest.request(api, "DELETE", f"/api/v1/namespaces/{plain_ns}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--steady-seconds", type=int, default=120)
    parser.add_argument("--resync", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    args = parser.parse_args(argv)
    result = run(args)
    goals = {"converge_s": "<= 60", "steady_writes": "0", "peak_rss_mib": "<= 250"}
    print(f"{'metric':<26}{'value':>12}  goal")
    for key, value in result.items():
        print(f"{key:<26}{value!s:>12}  {goals.get(key, '')}")
    out = ROOT / "bench" / "results" / "operator_bench.json"
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
