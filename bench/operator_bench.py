"""Operator at fleet scale, against its floor: plain Deployments (not a test; prints a table).

    .venv/bin/python -m bench.operator_bench [--objects 1000] [--nodes 500] [--sites 5]
        [--steady-seconds 120] [--churn-rate 50] [--churn-seconds 60] [--out bench/results]

On the local control plane with a kwok fleet of `--nodes` fake nodes over `--sites` sites:

1. **Floor**: for each of N objects, the ConfigMap, Service and Deployment Ember would render,
   created by a plain client (no operator). Time from the first create to every Deployment
   ready. The namespace is then deleted and the bench waits until it is gone, so the Ember phase
   starts on the same empty cluster.
2. **Ember**: the operator (`python -m ember_operator`, its own process) and N
   InferenceDeployments. Time from the first create to every object reporting Ready for its
   generation. API writes per object: the operator's own counter (child applies, deletes,
   status patches), plus anything else written to the objects (seen on a watch) and the Events
   the operator posted.
3. **Steady state**: every write in the namespace over `--steady-seconds` (goal 0).
4. **Thermal churn**: pods' `ember.dev/Thermal` conditions patched the way runtimes write them
   (`ember_runtime.contract.thermal.thermal_condition`), `--churn-rate` changes a second spread
   over the fleet; the delay from each patch to its object's `status.hottestCelsius` showing the new
   temperature (p50/p99, goal p99 <= 2 s).
5. The operator's peak RSS (VmHWM) and CPU seconds.

Writes `NAME.{json,md,png}` under `--out` (NAME = operator_bench by default).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ember_operator import render
from ember_operator.api.models import parse_spec
from ember_operator.settings import OperatorSettings
from ember_runtime.contract.cache import INSTANCE_LABEL
from ember_runtime.contract.thermal import REASON_NORMAL, ThermalReading, thermal_condition
from kubernetes import config
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from bench.machine import steal_seconds
from tests.cluster.cluster import COMPONENTS, Cluster
from tests.cluster.fleet import node_manifest
from tests.cluster.paths import state_dir
from tests.cluster.procs import ProcessTable
from tests.operator import rest
from tests.operator.specs import fleet_manifest, rendered
from tests.support.net import free_port
from tests.support.waiting import poll, wait_for

ROOT = Path(__file__).resolve().parents[1]
NODE_PREFIX = "bench-"
GOALS = {"converge_ratio": 1.3, "steady_writes": 0, "churn_p99_s": 2.0, "peak_rss_mib": 250.0}
STRATEGIC_MERGE = "application/strategic-merge-patch+json"


# ----------------------------------------------------------------------------- cluster helpers


def _namespace(api: ApiClient, name: str) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    rest.request(api, "POST", "/api/v1/namespaces", body=body)


def _drop_namespace(api: ApiClient, name: str, timeout: float = 600) -> float:
    """Delete and wait until it is gone (its pods too); returns seconds."""
    start = time.monotonic()
    rest.request(api, "DELETE", f"/api/v1/namespaces/{name}")

    def gone() -> bool:
        try:
            rest.request(api, "GET", f"/api/v1/namespaces/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    poll(gone, timeout, 2)  # the figure is the time it took, however long
    return time.monotonic() - start


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a live process (OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of the local cluster's processes (and the operator) over one phase: where a
    phase's time goes on a 2-core machine. Only processes in the local cluster's process table
    are counted (none when it runs no cluster, e.g. with --kubeconfig)."""

    def __init__(self, extra: dict[str, int] | None = None) -> None:
        procs = ProcessTable(state_dir())
        pids = {name: procs.pid(name) for name in COMPONENTS}
        self.pids = {**{n: p for n, p in pids.items() if p is not None}, **(extra or {})}
        self.start = {name: self._cpu(pid) for name, pid in self.pids.items()}
        self.steal_start = steal_seconds()

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            return _cpu_of(pid)
        except OSError:  # gone mid-phase: its delta goes negative and is left out
            return 0.0

    def stolen(self) -> float:
        """CPU seconds the hypervisor ran something else while this VM wanted its CPUs."""
        return round(steal_seconds() - self.steal_start, 1)

    def used(self) -> dict[str, float]:
        now = {name: self._cpu(pid) - self.start[name] for name, pid in self.pids.items()}
        return {name: round(cpu, 1) for name, cpu in sorted(now.items()) if cpu >= 0.05}


def _parallel(fn: Callable[[Any], Any], items: list[Any], workers: int = 8) -> None:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, items))


def make_fleet(api: ApiClient, n: int, sites: int) -> list[str]:
    names = [f"{NODE_PREFIX}{i}" for i in range(n)]

    def create(i: int) -> None:
        try:
            body = node_manifest(names[i], f"site-{i % sites}")
            rest.request(api, "POST", "/api/v1/nodes", body=body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    _parallel(create, list(range(n)))
    return names


def drop_fleet(api: ApiClient, names: list[str]) -> None:
    def delete(name: str) -> None:
        try:
            rest.request(api, "DELETE", f"/api/v1/nodes/{name}")
        except ApiException as exc:
            if exc.status != 404:
                raise

    _parallel(delete, names)


class ReadyTracker:
    """Follows one kind in one namespace by watch (a LIST every 2 s of 1,000 objects would load
    the API server the bench measures) and notes when `ready(obj)` holds for `total` objects."""

    def __init__(
        self, api: ApiClient, kind: str, ns: str, total: int, ready: Callable[[Any], bool]
    ) -> None:
        self.total, self._ready = total, ready
        self.done: set[str] = set()
        self.finished = threading.Event()
        self.finished_at = 0.0
        self._api, self._kind, self._ns = api, kind, ns
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.finished.is_set():
            for event in rest.watch(self._api, self._kind, self._ns, 300):
                obj = event["object"]
                name = obj.get("metadata", {}).get("name")
                if event["type"] in ("ADDED", "MODIFIED") and self._ready(obj):
                    self.done.add(name)
                if len(self.done) >= self.total:
                    self.finished_at = time.monotonic()
                    self.finished.set()
                    return

    def wait(self, start: float, timeout: float) -> float | None:
        """Seconds from `start` until all were ready; None if not within `timeout`."""
        last = -1
        while not self.finished.wait(5 if timeout > 5 else timeout):
            if time.monotonic() - start > timeout:
                return None
            if len(self.done) != last:
                last = len(self.done)
                print(f"  {time.monotonic() - start:6.1f}s  {last}/{self.total}", file=sys.stderr)
        return self.finished_at - start


def _deployment_ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return bool(st.get("readyReplicas", 0) >= obj["spec"]["replicas"] > 0)


def _infd_ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return bool(
        st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("readyReplicas", 0) >= obj["spec"]["replicas"]
    )


# ----------------------------------------------------------------------------- the floor


def floor_bodies(n: int, ns: str, sites: list[str]) -> list[dict[str, Any]]:
    """What Ember renders for each object, minus the owner reference."""
    settings = OperatorSettings()
    bodies: list[dict[str, Any]] = list(render.runtime_identity(ns, settings))
    for i in range(n):
        spec = parse_spec(fleet_manifest(f"p{i}", sites)["spec"])
        for manifest in rendered(render.Owner(f"p{i}", ns, ""), spec, settings):
            manifest["metadata"].pop("ownerReferences", None)
            bodies.append(manifest)
    return bodies


def _create(api: ApiClient, manifest: dict[str, Any]) -> None:
    from ember_operator.apply import object_path

    meta = manifest["metadata"]
    rest.request(api, "POST", object_path(manifest["kind"], meta["namespace"]), body=manifest)


def run_floor(api: ApiClient, n: int, sites: list[str], timeout: float) -> dict[str, Any]:
    ns = f"bench-plain-{os.getpid()}"
    _namespace(api, ns)
    bodies = floor_bodies(n, ns, sites)
    tracker = ReadyTracker(api, "deployments", ns, n, _deployment_ready)
    tracker.start()
    time.sleep(1)
    start, cpu = time.monotonic(), CpuMeter()
    _parallel(lambda b: _create(api, b), bodies)
    converge = tracker.wait(start, timeout)
    cpu_used, stolen = cpu.used(), cpu.stolen()
    gone = _drop_namespace(api, ns)
    print(f"floor: {converge}s; namespace gone in {gone:.0f}s", file=sys.stderr)
    converge = None if converge is None else round(converge, 1)
    return {
        "converge_s": converge,
        "writes_per_object": round(len(bodies) / n, 2),
        "cpu_by_process_s": cpu_used,
        "cpu_stolen_s": stolen,
    }


# ----------------------------------------------------------------------------- the operator


class OperatorProcess:
    def __init__(self, kubeconfig: Path, ns: str, log: Path) -> None:
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}",
        }
        cmd = [sys.executable, "-m", "ember_operator", "--standalone", "-n", ns]
        cmd += ["--metrics-port", str(self.metrics_port), "--liveness-port", "0"]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def _status_mib(self, field: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def peak_rss_mib(self) -> float:
        return self._status_mib("VmHWM")  # the kernel's own peak record

    def rss_mib(self) -> float:
        return self._status_mib("VmRSS")

    def cpu_seconds(self) -> float:
        return _cpu_of(self.proc.pid)

    def _metrics(self) -> list[str]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text: str = urllib.request.urlopen(url, timeout=5).read().decode()
        return text.splitlines()

    def writes(self) -> dict[str, float]:
        """The operator's own counter, by kind/verb."""
        out: dict[str, float] = {}
        for line in self._metrics():
            if line.startswith("ember_operator_api_writes_total{"):
                labels, value = line.rsplit(" ", 1)
                out[labels[len("ember_operator_api_writes_total") :]] = float(value)
        return out

    def histogram(self, name: str) -> dict[float, float]:
        """One histogram of the operator's metrics: upper bound -> cumulative count."""
        out: dict[float, float] = {}
        prefix = f'{name}_bucket{{le="'
        for line in self._metrics():
            if line.startswith(prefix):
                le, value = line[len(prefix) :].split('"}', 1)
                out[float(le)] = float(value)
        return out

    def wait_serving(self, timeout: float = 60) -> None:
        """Until the operator's metrics answer (with no write counted yet, maybe)."""
        wait_for(
            "the operator's metrics",
            lambda: self.writes() is not None,  # an OSError until the operator listens
            timeout,
            0.5,
            tolerate=(OSError,),
        )

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


@contextmanager
def watching(api: ApiClient, kind: str, ns: str, seconds: int) -> Iterator[list[dict[str, Any]]]:
    """Every event of `kind` in `ns` while the block runs (and at most `seconds`)."""
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def run() -> None:
        for event in rest.watch(api, kind, ns, seconds):
            seen.append(event)
            if stop.is_set():
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)
    try:
        yield seen
    finally:
        stop.set()


def _total(writes: dict[str, float]) -> float:
    return sum(writes.values())


def _status_writes(writes: dict[str, float]) -> float:
    return sum(v for k, v in writes.items() if 'verb="status"' in k)


def converge_ember(
    api: ApiClient, op: OperatorProcess, ns: str, sites: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    n, timeout = args.objects, args.timeout
    tracker = ReadyTracker(api, "infd", ns, n, _infd_ready)
    tracker.start()
    # The children's own readiness, to split Ember's time into "children up" and "status says".
    children = ReadyTracker(api, "deployments", ns, n, _deployment_ready)
    children.start()
    with (
        watching(api, "infd", ns, int(timeout) + 60) as infd_events,
        watching(api, "events", ns, int(timeout) + 60) as events,
    ):
        time.sleep(1)
        start, cpu = time.monotonic(), CpuMeter({"ember-operator": op.proc.pid})
        _parallel(
            lambda i: rest.create(api, "infd", ns, fleet_manifest(f"m{i}", sites)),
            list(range(n)),
        )
        converge = tracker.wait(start, timeout)
        cpu_used, stolen = cpu.used(), cpu.stolen()
        deployments = children.wait(start, 0.1) if children.finished.is_set() else None
        time.sleep(5)  # writes still in flight reach the watches
    writes = op.writes()
    modified = sum(1 for e in infd_events if e["type"] == "MODIFIED")
    ours = [
        e
        for e in events
        if e["type"] == "ADDED"
        and (e["object"].get("source") or {}).get("component") in ("kopf", "ember-operator")
    ]
    other = max(0.0, modified - _status_writes(writes))  # e.g. finalizers, Kopf annotations
    return {
        "converge_s": None if converge is None else round(converge, 1),
        "deployments_ready_s": None if deployments is None else round(deployments, 1),
        "writes_per_object": round((_total(writes) + other + len(ours)) / n, 2),
        "writes_breakdown": {**writes, "other object writes": other, "events": len(ours)},
        "peak_rss_after_converge_mib": round(op.peak_rss_mib(), 1),
        "rss_after_converge_mib": round(op.rss_mib(), 1),
        "cpu_after_converge_s": round(op.cpu_seconds(), 1),
        "cpu_by_process_s": cpu_used,
        "cpu_stolen_s": stolen,
    }


def steady_state(api: ApiClient, op: OperatorProcess, ns: str, seconds: int) -> dict[str, Any]:
    before = _total(op.writes())
    kinds = ["infd", "deployments", "services", "configmaps", "pdbs", "events"]
    seen = rest.count_writes(api, ns, kinds, seconds)
    return {"steady_writes": len(seen) + _total(op.writes()) - before, "steady_seen": seen[:20]}


# ----------------------------------------------------------------------------- thermal churn


class Churn:
    """Patches pods' thermal conditions at `rate`/s and times each until its owner shows it."""

    def __init__(self, api: ApiClient, ns: str, pods: dict[str, str]) -> None:
        self.api, self.ns = api, ns
        self.owner_pods = pods  # owner -> pod
        self.pending: dict[str, tuple[int, float]] = {}  # owner -> (temperature, sent at)
        self.delays: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def follow(self) -> None:
        for event in rest.watch(self.api, "infd", self.ns, 3600):
            if self.stop.is_set():
                return
            obj = event["object"]
            name, hottest = obj["metadata"]["name"], (obj.get("status") or {}).get("hottestCelsius")
            seen_at = time.monotonic()
            with self.lock:
                want = self.pending.get(name)
                if want is not None and hottest == want[0]:
                    self.delays.append(seen_at - want[1])
                    del self.pending[name]

    def patch(self, owner: str, temperature: int) -> None:
        reading = ThermalReading(REASON_NORMAL, temperature, 16, 16)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {"conditions": [thermal_condition(reading, now)]}}
        with self.lock:
            self.pending[owner] = (temperature, time.monotonic())
        path = f"/api/v1/namespaces/{self.ns}/pods/{self.owner_pods[owner]}/status"
        rest.request(self.api, "PATCH", path, body=body, content_type=STRATEGIC_MERGE)

    def run(self, rate: float, seconds: float) -> dict[str, Any]:
        follower = threading.Thread(target=self.follow, daemon=True)
        follower.start()
        time.sleep(1)
        owners = list(self.owner_pods)
        random.Random(7).shuffle(owners)
        total = int(rate * seconds)
        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            for i in range(total):
                due = start + i / rate
                time.sleep(max(0.0, due - time.monotonic()))
                pool.submit(self.patch, owners[i % len(owners)], 40 + (i // len(owners)) % 50)
        time.sleep(10)  # the tail reaches the watch
        self.stop.set()
        with self.lock:
            missed = len(self.pending)
            delays = sorted(self.delays)
        return {
            "churn_changes": total,
            "churn_achieved_rate": round(total / (time.monotonic() - start - 10), 1),
            "churn_seen": len(delays),
            "churn_missed": missed,
            "churn_p50_s": round(_pct(delays, 0.50), 3) if delays else None,
            "churn_p99_s": round(_pct(delays, 0.99), 3) if delays else None,
            "churn_max_s": round(delays[-1], 3) if delays else None,
        }


def observed(before: dict[float, float], after: dict[float, float]) -> float:
    """How many observations a histogram took between two snapshots (its +Inf bucket)."""
    return after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)


def bucket_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """The upper bound of the histogram bucket that holds quantile `q` of what was observed
    between two snapshots; None when nothing was, or when it lies past the last finite bound
    (JSON has no infinity)."""
    total = observed(before, after)
    if total <= 0:
        return None
    for le in sorted(after):
        if after[le] - before.get(le, 0.0) >= q * total:
            return None if le == float("inf") else le
    return None


def churn_with_lag(
    api: ApiClient, op: OperatorProcess, ns: str, rate: float, seconds: float
) -> dict[str, Any]:
    """The churn, plus where its delay sits: the operator's own status queue (from the first
    pod event of a change to its status written, `ember_operator_status_lag_seconds`) against
    the whole path, and what each process spent meanwhile."""
    lag = "ember_operator_status_lag_seconds"
    before, cpu = op.histogram(lag), CpuMeter({"ember-operator": op.proc.pid})
    result = Churn(api, ns, pods_by_owner(api, ns)).run(rate, seconds)
    after = op.histogram(lag)
    result["churn_status_lag_le_s"] = {
        "p50": bucket_quantile(before, after, 0.50),
        "p99": bucket_quantile(before, after, 0.99),
        "refreshes": observed(before, after),
    }
    result["churn_cpu_by_process_s"], result["churn_cpu_stolen_s"] = cpu.used(), cpu.stolen()
    return result


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def pods_by_owner(api: ApiClient, ns: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pod in rest.items(api, "pods", ns, label_selector="app.kubernetes.io/name=ember"):
        owner = pod["metadata"]["labels"].get(INSTANCE_LABEL)
        if owner and not pod["metadata"].get("deletionTimestamp"):
            out[owner] = pod["metadata"]["name"]
    return out


# ----------------------------------------------------------------------------- the run


def run_ember(
    api: ApiClient, kubeconfig: Path, args: argparse.Namespace, sites: list[str]
) -> dict[str, Any]:
    ns = f"bench-{os.getpid()}"
    _namespace(api, ns)
    op = OperatorProcess(kubeconfig, ns, args.out / f"{args.name}.operator.log")
    try:
        op.wait_serving()
        result = converge_ember(api, op, ns, sites, args)
        print(f"steady state: {args.steady_seconds}s", file=sys.stderr)
        result |= steady_state(api, op, ns, args.steady_seconds)
        print(f"churn: {args.churn_rate}/s for {args.churn_seconds}s", file=sys.stderr)
        result |= churn_with_lag(api, op, ns, args.churn_rate, args.churn_seconds)
        result["peak_rss_mib"] = round(op.peak_rss_mib(), 1)
        result["rss_at_end_mib"] = round(op.rss_mib(), 1)
        result["cpu_s"] = round(op.cpu_seconds(), 1)
    finally:
        result_rc = op.stop()
        _drop_namespace(api, ns)
    result["operator_exit_code"] = result_rc
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    own = args.kubeconfig is None
    cluster = Cluster() if own else None
    if cluster is not None:
        cluster.up(with_node=False)
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/inferencedeployments.ember.dev")
    kubeconfig = cluster.kubeconfig if cluster is not None else Path(args.kubeconfig)
    api = config.new_client_from_config(str(kubeconfig))
    sites = [f"site-{i}" for i in range(args.sites)]
    load_before = os.getloadavg()
    nodes = make_fleet(api, args.nodes, args.sites)
    try:
        print("floor: plain ConfigMap + Service + Deployment", file=sys.stderr)
        floor = run_floor(api, args.objects, sites, args.timeout) if args.floor else {}
        print("ember: InferenceDeployments", file=sys.stderr)
        ember = run_ember(api, kubeconfig, args, sites)
    finally:
        drop_fleet(api, nodes)
        if cluster is not None and not args.keep_cluster:
            cluster.down()
    return {
        "objects": args.objects,
        "nodes": args.nodes,
        "sites": args.sites,
        "steady_window_s": args.steady_seconds,
        "churn_rate": args.churn_rate,
        "churn_seconds": args.churn_seconds,
        "floor": floor,
        "ember": ember,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# ----------------------------------------------------------------------------- report


def goals(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(metric, ember, floor/peer, goal, verdict) rows."""
    e, f = result["ember"], result["floor"]
    rows = []
    conv, floor_conv = e.get("converge_s"), f.get("converge_s")
    if conv is not None and floor_conv:
        ratio = conv / floor_conv
        verdict = f"{'met' if ratio <= GOALS['converge_ratio'] else 'missed'} ({ratio:.2f}x floor)"
    else:
        verdict = "not measured"
    rows.append(("create → all Ready (s)", _s(conv), _s(floor_conv), "<= 1.3x floor", verdict))
    rows.append(
        ("… their Deployments all ready (s)", _s(e.get("deployments_ready_s")), "-", "-", "-")
    )
    rows.append(
        (
            "API writes per object",
            _s(e["writes_per_object"]),
            _s(f.get("writes_per_object")),
            "children once + status per change",
            "see breakdown",
        )
    )
    steady = e["steady_writes"]
    rows.append(
        (
            f"writes in {result['steady_window_s']} s steady",
            _s(steady),
            "0",
            "0",
            "met" if steady == 0 else "missed",
        )
    )
    p99 = e.get("churn_p99_s")
    rows.append(
        (
            "thermal churn p99 delay (s)",
            _s(p99),
            "-",
            "<= 2",
            "not measured"
            if p99 is None
            else f"{'met' if p99 <= 2 else 'missed'} ({p99 / 2:.2f}x goal)",
        )
    )
    rss = e["peak_rss_mib"]
    rows.append(
        (
            "operator peak RSS (MiB)",
            _s(rss),
            "-",
            "<= 250",
            f"{'met' if rss <= 250 else 'missed'} ({rss / 250:.2f}x goal)",
        )
    )
    rows.append(("operator CPU (s), whole run", _s(e["cpu_s"]), "-", "-", "-"))
    return rows


def _s(value: Any) -> str:
    return "-" if value is None else str(value)


def markdown(result: dict[str, Any]) -> str:
    e = result["ember"]
    lines = [
        "# Operator at fleet scale",
        "",
        f"{result['objects']} InferenceDeployments on {result['nodes']} kwok nodes over "
        f"{result['sites']} sites; {result['cpus']} CPUs; load average before "
        f"{result['loadavg_before']}, after {result['loadavg_after']}; {result['when']}.",
        f"Command: `{result['command']}`.",
        "",
        "| metric | Ember | floor (plain client) | goal | verdict |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in goals(result)),
        "",
        f"Thermal churn: {e['churn_changes']} pod-condition changes at "
        f"{e['churn_achieved_rate']}/s; seen {e['churn_seen']}, missed {e['churn_missed']}; "
        f"p50 {e['churn_p50_s']} s, p99 {e['churn_p99_s']} s, max {e['churn_max_s']} s.",
        *_lag_lines(e),
        "",
        "Writes during convergence, by kind and verb (the operator's own counter, plus other "
        "writes to the objects and Events it posted):",
        "",
        *(f"- `{k}`: {v:g}" for k, v in e["writes_breakdown"].items()),
        "",
        f"Operator RSS: peak {e['peak_rss_after_converge_mib']} MiB by the end of convergence, "
        f"{e['rss_after_converge_mib']} MiB resident then, {e['rss_at_end_mib']} MiB at the end; "
        f"CPU {e['cpu_after_converge_s']} s by the end of convergence; exit code on SIGTERM "
        f"{e['operator_exit_code']}.",
        "",
        "CPU seconds by process from the first create to all Ready (the bench's own client "
        "not included):",
        "",
        "| process | floor | Ember |",
        "|---|---|---|",
        *_cpu_rows(result["floor"].get("cpu_by_process_s", {}), e.get("cpu_by_process_s", {})),
        "",
        "CPU seconds the hypervisor gave to others while this VM wanted them (steal, from "
        f"/proc/stat) over the same spans: floor {result['floor'].get('cpu_stolen_s', '-')}, "
        f"Ember {e.get('cpu_stolen_s', '-')}.",
    ]
    return "\n".join(lines) + "\n"


def _lag_lines(e: dict[str, Any]) -> list[str]:
    lag = e.get("churn_status_lag_le_s")
    if not lag:
        return []
    cpu = ", ".join(f"{k} {v}" for k, v in e.get("churn_cpu_by_process_s", {}).items())
    return [
        f"Of that delay, the operator's own status queue (first pod event of a change to its "
        f"status written, histogram `ember_operator_status_lag_seconds`, bucket bounds): "
        f"p50 <= {_s(lag['p50'])} s, p99 <= {_s(lag['p99'])} s over {lag['refreshes']:g} "
        "refreshes (- : past the last bound, 60 s). "
        f"CPU seconds during the churn and its 10 s tail: {cpu}; steal "
        f"{e.get('churn_cpu_stolen_s', '-')}.",
    ]


def _cpu_rows(floor: dict[str, float], ember: dict[str, float]) -> list[str]:
    names = sorted(set(floor) | set(ember), key=lambda n: -ember.get(n, floor.get(n, 0.0)))
    rows = [f"| {n} | {floor.get(n, '-')} | {ember.get(n, '-')} |" for n in names]
    total = f"| all | {sum(floor.values()):.1f} | {sum(ember.values()):.1f} |"
    return [*rows, total] if names else []


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e, f = result["ember"], result["floor"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(
        ["floor", "Ember"],
        [f.get("converge_s") or 0, e.get("converge_s") or 0],
        color=["grey", "tab:orange"],
    )
    if f.get("converge_s"):
        axes[0].axhline(1.3 * f["converge_s"], ls="--", color="k", label="goal 1.3x floor")
        axes[0].legend()
    axes[0].set_title(f"create → all Ready (s), {result['objects']} objects")
    axes[1].bar(
        ["floor", "Ember"],
        [f.get("writes_per_object") or 0, e["writes_per_object"]],
        color=["grey", "tab:orange"],
    )
    axes[1].set_title("API writes per object")
    axes[2].bar(["peak RSS"], [e["peak_rss_mib"]], color="tab:orange")
    axes[2].axhline(250, ls="--", color="k", label="goal 250 MiB")
    axes[2].legend()
    axes[2].set_title("operator memory (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--steady-seconds", type=int, default=120)
    parser.add_argument("--churn-rate", type=float, default=50.0)
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--no-floor", dest="floor", action="store_false")
    parser.add_argument("--kubeconfig", help="use this cluster instead of starting the local one")
    parser.add_argument("--keep-cluster", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="operator_bench")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    flags = sys.argv[1:] if argv is None else argv
    result["command"] = " ".join([".venv/bin/python -m bench.operator_bench", *flags])
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / f"{args.name}.md").write_text(text)
    plot(result, args.out / f"{args.name}.png")
    print(text)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
