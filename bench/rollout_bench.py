"""A model change rolled out site by site, against the same change as a plain Deployment rolling
update (not a test; writes bench/results/rollout.{md,json,png}).

    flock /tmp/ember-cpu.lock .venv/bin/python -m bench.rollout_bench [--sites 50]
        [--only a,b,c,d-halt,d-skip,plain-a,plain-b,plain-c,plain-d] [--real-agents 50]
        [--canary-bake 30] [--bake 20] [--outage 90] [--out bench/results]

On the local control plane (started if it is not running): `--sites` sites of two kwok Nodes
each (site-00 …), one InferenceDeployment of Gemma 3 270M with one replica per site, its model
over http from a counting origin on loopback. Each scenario starts from a freshly completed
first version (v1) and changes it:

- **a**: a good new version (a new model file: new digest, so every site stages it);
- **b**: a version that fails to load (a truncated GGUF with its own valid digest);
- **c**: a version whose first token is about 3x slower (the CPU limit 1 → 250m: the same
  llama.cpp thread under a quarter-CPU CFS quota);
- **d-halt / d-skip**: the good version with one site of the second wave offline during that
  wave, `onUnreachable: Halt` and then `Skip`;
- **plain-***: the same changes to the same object without `spec.rollout` (one Deployment over
  every site, the operator's rolling-update strategy).

What is real and what is emulated is in the results file's first section (and
tests/drills/rollout_support.py's docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ember_operator.api.models import parse_spec
from ember_runtime.contract.cache import cache_label
from ember_runtime.contract.config import (
    EngineConfig,
    RuntimeConfig,
    SensorConfig,
    ServerConfig,
    fetch_from_spec,
)
from ember_runtime.contract.rollout import parse_health_condition
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from bench.machine import steal_seconds
from bench.operator_bench import OperatorProcess
from tests.cluster.build import ensure_binaries
from tests.cluster.cluster import Cluster
from tests.cluster.fleet import SIM_TOLERATION
from tests.cluster.paths import state_dir
from tests.cluster.procs import ProcessTable
from tests.conftest import Kube
from tests.drills import rollout_support as rs
from tests.operator import rest
from tests.support.model import default_model_path
from tests.support.net import free_port
from tests.support.waiting import wait_for
from tests.thermal.kube_support import runtime_policy

ROOT = Path(__file__).resolve().parents[1]
NS = "rollout-bench"
MODEL_NAME = "gemma-3-270m"
FILE = "gemma.gguf"
RING = "ring-1"
BAD_BYTES = 32 << 20  # the truncated upload: its first 32 MiB
PAD_BYTES = 4096  # the good new version: the same weights and 4 KiB more (a new digest)
V1_CPU = "1"  # one llama.cpp thread (two real replicas of two threads would oversubscribe 2 cores)
SLOW_CPU = "250m"
GATE = {
    "readyTimeoutSeconds": 600,
    "maxErrorRateIncreasePercent": 2,
    "maxTtftRatioPercent": 200,
    "minRequests": 5,
}
UNREACHABLE_AFTER_S = 30
LEAD_S = 5.0  # the offline site goes away this long before its wave starts
KINDS = {"a": "good", "b": "bad-load", "c": "slow", "d": "good"}
COLORS = {"v1": "0.7", "new": "tab:green", "broken": "tab:red", "down": "tab:orange"}
COLORS["offline"] = "tab:purple"


@dataclass(frozen=True)
class Scenario:
    key: str  # a, b, c, d-halt, d-skip, plain-a, …
    rollout: bool
    offline: str | None = None  # the onUnreachable policy (or "plain"): one site goes away

    @property
    def change(self) -> str:
        return KINDS[self.key.removeprefix("plain-")[0]]

    @property
    def name(self) -> str:  # the InferenceDeployment's
        return ("r" if self.rollout else "p") + self.key.removeprefix("plain-").replace("-", "")


SCENARIOS = {
    "a": Scenario("a", True),
    "b": Scenario("b", True),
    "c": Scenario("c", True),
    "d-halt": Scenario("d-halt", True, "Halt"),
    "d-skip": Scenario("d-skip", True, "Skip"),
    "plain-a": Scenario("plain-a", False),
    "plain-b": Scenario("plain-b", False),
    "plain-c": Scenario("plain-c", False),
    "plain-d": Scenario("plain-d", False, "plain"),
}
TITLES = {
    "good": "a good new version (new model file)",
    "bad-load": "a version that fails to load (truncated GGUF)",
    "slow": f"a version with a slower first token (CPU limit {V1_CPU} → {SLOW_CPU})",
}


# ----------------------------------------------------------------------------- model files


@dataclass(frozen=True)
class VersionFile:
    """One version's GGUF as the bench's origin serves it: a file here, its digest and size."""

    path: Path
    sha256: str
    size: int


def _write(path: Path, chunks: Callable[[], list[bytes]]) -> VersionFile:
    digest, size = hashlib.sha256(), 0
    with path.open("wb") as out:
        for chunk in chunks():
            out.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return VersionFile(path, digest.hexdigest(), size)


def model_files(work: Path) -> dict[str, VersionFile]:
    """v1: the packaged Gemma GGUF; v2: the same and 4 KiB of padding (llama.cpp reads
    tensors by offset, so it loads the same); bad: its first 32 MiB (an upload cut short)."""
    gemma = default_model_path()
    data = gemma.read_bytes()
    v1 = VersionFile(gemma, hashlib.sha256(data).hexdigest(), len(data))
    v2 = _write(work / "v2.gguf", lambda: [data, b"\0" * PAD_BYTES])
    bad = _write(work / "bad.gguf", lambda: [data[:BAD_BYTES]])
    return {"v1": v1, "v2": v2, "bad": bad}


def model_spec(origin: str, which: str, f: VersionFile) -> dict[str, Any]:
    return {
        "name": MODEL_NAME,
        "format": "gguf",
        "source": {"http": {"urls": {FILE: f"{origin}/{which}.gguf"}}},
        "files": [{"path": FILE, "sha256": f.sha256, "sizeBytes": f.size}],
    }


def fetch_hash(spec: dict[str, Any]) -> str:
    """The pods' `ember.dev/model-fetch-hash`, computed as the operator renders it."""
    model = parse_spec(spec).model.model_dump(by_alias=True, mode="json", exclude_none=True)
    fetch = fetch_from_spec(model)
    assert fetch is not None
    return fetch.digest()


def relay_message(bad: VersionFile, work: Path) -> tuple[int, str]:
    """The real runtime on the truncated file, once: its exit code and what the kubelet would
    report (`rs.termination_message`). kwok replicas of that version report the same."""
    work.mkdir(parents=True, exist_ok=True)
    view = work / "model.gguf"
    view.unlink(missing_ok=True)
    view.symlink_to(bad.path)
    cfg = RuntimeConfig(
        model_name=MODEL_NAME,
        model_dir=str(work),
        engine=EngineConfig(threads=2),
        server=ServerConfig(host="127.0.0.1", port=free_port()),
        sensors=SensorConfig(sysfs_root=str(work / "sys"), report_condition=False),
        termination_log=str(work / "termination-log"),
    )
    (work / "config.yaml").write_text(cfg.to_yaml())
    argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(work / "config.yaml")]
    argv += ["--model", str(view), "--log-level", "warning"]
    with (work / "runtime.log").open("wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=180, check=False)
    message = rs.termination_message(work / "termination-log", work / "runtime.log")
    return proc.returncode, message


# ----------------------------------------------------------------------------- the spec


@dataclass
class Plan:
    sites: list[str]
    real_sites: list[str]  # sites whose replica is a real runtime process
    offline_site: str
    canary_bake: int
    bake: int
    outage_s: float
    origin: str = ""
    files: dict[str, VersionFile] = field(default_factory=dict)

    @property
    def ring(self) -> list[str]:
        """The second wave's sites (ring label, a selector wave): 10 % of the fleet."""
        n = max(1, len(self.sites) // 10)
        return self.sites[1 : 1 + n]


def manifest(plan: Plan, sc: Scenario) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": len(plan.sites),
        "model": model_spec(plan.origin, "v1", plan.files["v1"]),
        "placement": {"sites": plan.sites, "tolerations": [SIM_TOLERATION]},
        "resources": {
            "requests": {"cpu": "100m", "memory": "512Mi"},
            "limits": {"cpu": V1_CPU, "memory": "2Gi"},
        },
    }
    if sc.rollout:
        spec["rollout"] = rollout_spec(plan, sc.offline or "Halt")
    return {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": sc.name},
        "spec": spec,
    }


def rollout_spec(plan: Plan, on_unreachable: str) -> dict[str, Any]:
    return {
        "waves": [
            {"name": "canary", "sites": plan.sites[:1], "bakeSeconds": plan.canary_bake},
            {
                "name": RING,
                "selector": {"matchLabels": {rs.RING_LABEL: RING}},
                "bakeSeconds": plan.bake,
            },
        ],
        "gate": GATE,
        "unreachableAfterSeconds": UNREACHABLE_AFTER_S,
        "onUnreachable": on_unreachable,
    }


def change(plan: Plan, kind: str) -> dict[str, Any]:
    """The spec patch of each change (a merge patch: `files` is replaced whole)."""
    if kind == "slow":
        return {"resources": {"limits": {"cpu": SLOW_CPU}}}
    which = "v2" if kind == "good" else "bad"
    return {"model": model_spec(plan.origin, which, plan.files[which])}


# ----------------------------------------------------------------------------- the world


def _kube(cluster: Cluster) -> Kube:
    api = kube_config.new_client_from_config(str(cluster.kubeconfig))
    return Kube(cluster=cluster, kubeconfig=cluster.kubeconfig, api=api)


class World:
    """Everything the scenarios share: the cluster, sites, kwok, origin, agents, operator, the
    kubelet's part, the watches."""

    def __init__(self, plan: Plan, args: argparse.Namespace) -> None:
        self.plan, self.args = plan, args
        self.work = Path(args.work)
        self.cluster = Cluster()
        self.kube = _kube(self.cluster)
        self.site_of_node = {n: s for s in plan.sites for n in rs.node_names(s)}
        self.versions = rs.Versions()
        self.timeline = rs.Timeline(plan.sites, self.site_of_node, self.versions)
        self.status_log: list[tuple[float, dict[str, Any]]] = []
        self.log_lock = threading.Lock()
        self.closers: list[Callable[[], object]] = []
        self.facts: dict[str, Any] = {}

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        self.cluster.up(with_node=False)
        kubectl = self.cluster.kubectl
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        kubectl("wait", "--for=condition=Established", "crd/inferencedeployments.ember.dev")
        self._namespace()
        self.plan.files = model_files(self.work)
        code, relay = relay_message(self.plan.files["bad"], self.work / "relay")
        self.facts["bad_version_exit"] = {"exit_code": code, "message": relay}
        self._origin()
        self._kwok()
        self._nodes()
        self._agents()
        policy = runtime_policy(self.kube, self.work)  # removed again at the end: a Helm
        policy.__enter__()  # install (the e2e's) refuses a ClusterRole it does not own
        self.closers.append(lambda: policy.__exit__(None, None, None))
        self._operator()
        self._kubelet(relay)

    def _namespace(self) -> None:
        """A fresh namespace (an earlier run's, still going away, first gone); deleted at the
        end, after its InferenceDeployments (while the operator can still finalize them)."""
        api, path = self.kube.api, f"/api/v1/namespaces/{NS}"
        wait_for("the last run's namespace gone", lambda: not _exists(api, path), 300, 2)
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        rest.request(api, "POST", "/api/v1/namespaces", body=body)
        self.closers.append(lambda: rest.request(api, "DELETE", path))

    def _kwok(self) -> None:
        plan = self.plan
        real_nodes = [n for s in plan.real_sites for n in rs.node_names(s)]
        bad_spec = manifest(plan, SCENARIOS["plain-b"])["spec"]
        bad_spec.update(change(plan, "bad-load"))
        stages = self.work / "kwok-stages.yaml"
        stages.write_text(rs.kwok_stages(real_nodes, [fetch_hash(bad_spec)]))
        self.kwok = rs.BenchKwok(
            ensure_binaries() / "kwok", self.cluster.kubeconfig, stages, self.work / "kwok.log"
        )
        self.closers.append(self.kwok.stop)

    def _nodes(self) -> None:
        api, plan = self.kube.api, self.plan
        bodies = [
            rs.site_node(node, site, RING if site in plan.ring else "ring-2")
            for site in plan.sites
            for node in rs.node_names(site)
        ]
        rs.create_nodes(api, bodies)
        self.closers.append(lambda: rs.delete_nodes(api))
        names = [b["metadata"]["name"] for b in bodies]
        wait_for("the sites' nodes Ready", lambda: rs.nodes_ready(api, names), 300, 1)

    def _origin(self) -> None:
        """The origin (its URL is in every spec, and in the fetch hash kwok is told of)."""
        plan = self.plan
        self.real_agent_sites = set(plan.sites[: self.args.real_agents]) | set(plan.real_sites)
        agents_dir = self.work / "agents"
        agents_dir.mkdir(exist_ok=True)
        self.agents = rs.Agents(
            self.kube, NS, agents_dir, plan.sites, self.real_agent_sites, set(plan.real_sites)
        )
        files = {f"{k}.gguf": f.path for k, f in plan.files.items()}
        self.origin = rs.CountingOrigin(files, self.agents.pids)
        plan.origin = self.origin.url
        self.closers += [self.origin.close, self.agents.close]

    def _agents(self) -> None:
        """The agents, and the first version on every site (`warm`): its WAN bytes are the
        set-up's, not a scenario's."""
        plan, real = self.plan, self.real_agent_sites
        warm = manifest(plan, Scenario("warm", False))
        warm["metadata"]["name"], warm["spec"]["replicas"] = "warm", 0
        rest.create(self.kube.api, "infd", NS, warm)
        started = time.monotonic()
        self.agents.start(("warm", warm["spec"]["model"]))
        if self.args.agent_shares:
            self.facts["agent_cpu_shares"] = (
                self.agents.demote(self.args.agent_shares) and self.args.agent_shares
            )
        wait_for("v1 on every site", lambda: _staged(self, plan.files["v1"].sha256), 1800, 5)
        self.facts["agents"] = {
            "real_processes": len(self.agents.pids()),
            "real_sites": len(real),
            "emulated_sites": len(plan.sites) - len(real),
            "first_version_on_every_site_s": round(time.monotonic() - started, 1),
            "first_version_wan_bytes": sum(self.origin.state.snapshot().values()),
            "rss_mib_total": round(self.agents.rss_mib(), 1),
        }

    def _operator(self) -> None:
        self.operator = OperatorProcess(self.cluster.kubeconfig, NS, self.work / "operator.log")
        self.operator.wait_serving()
        self.closers += [self.operator.stop, self._drop_objects]

    def _drop_objects(self) -> None:
        api = self.kube.api
        for obj in rest.items(api, "infd", NS):
            rest.delete(api, "infd", NS, obj["metadata"]["name"])
        wait_for("the objects gone", lambda: not rest.items(api, "infd", NS), 120, 2)

    def _kubelet(self, relay: str) -> None:
        cfg = rs.KubeletConfig(
            NS, set(self.plan.real_sites), self.site_of_node, self.work / "replicas"
        )
        self.kubelet = rs.Kubelet(self.kube, cfg, self.agents, self.versions, relay)
        self.closers.append(self.kubelet.stop_all)
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(2.0):
                self.kubelet.sample_cpu()

        threading.Thread(target=sample, daemon=True).start()
        self.closers.append(sampling.set)

        def on_pod(kind: str, pod: dict[str, Any]) -> None:
            self.kubelet.on_pod(kind, pod)
            self.timeline.on_pod(kind, pod)

        query = [("labelSelector", rs.POD_SELECTOR)]
        pods = rs.Watcher(self.kube.api, f"/api/v1/namespaces/{NS}/pods", on_pod, query).start()
        infds = rs.Watcher(self.kube.api, rest.path("infd", NS), self._on_infd).start()
        self.closers += [pods.stop.set, infds.stop.set]

    def _on_infd(self, kind: str, obj: dict[str, Any]) -> None:
        rollout = (obj.get("status") or {}).get("rollout")
        if kind == "DELETED" or rollout is None:
            return
        with self.log_lock:
            if not self.status_log or self.status_log[-1][1] != rollout:
                self.status_log.append((time.time(), rollout))

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception as exc:  # tear everything down that can be
                print(f"close: {exc!r}", file=sys.stderr)
        for group in rs.CPU_CGROUP.glob(f"{rs.CGROUP_PREFIX}*"):
            with contextlib.suppress(OSError):
                group.rmdir()
        if not self.args.keep:
            shutil.rmtree(self.work / "agents", ignore_errors=True)


def _exists(api: Any, path: str) -> bool:
    try:
        rest.request(api, "GET", path)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


class CpuAccount:
    """CPU seconds by process over a span: the control plane, both kwoks, the operator, the
    agents, the real replicas (sampled every 2 s), this bench, and the machine in all."""

    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "etcd + kube-apiserver": ("etcd", "kube-apiserver"),
        "controller-manager + scheduler": ("kube-controller-manager", "kube-scheduler"),
        "cluster kwok": ("kwok",),
    }

    def __init__(self, w: World) -> None:
        self.w = w
        self.table = ProcessTable(state_dir())
        self.start = self.now()

    def _pids(self) -> dict[str, list[int]]:
        out = {
            name: [p for c in comps if (p := self.table.pid(c)) is not None]
            for name, comps in self.GROUPS.items()
        }
        out["bench kwok"] = [self.w.kwok.proc.pid]
        out["operator"] = [self.w.operator.proc.pid]
        out["node agents"] = list(self.w.agents.pids())
        out["bench (watches, kubelet part, load, origin)"] = [os.getpid()]
        return out

    def now(self) -> dict[str, float]:
        out = {name: sum(_cpu(p) for p in pids) for name, pids in self._pids().items()}
        out["real replicas"] = self.w.kubelet.cpu_total() if hasattr(self.w, "kubelet") else 0.0
        out["machine busy"], out["machine steal"] = _machine()
        return out

    def used(self) -> dict[str, float]:
        now = self.now()
        return {k: round(v - self.start.get(k, 0.0), 1) for k, v in now.items()}


def _cpu(pid: int) -> float:
    try:
        return rs.cpu_seconds(pid)
    except OSError:
        return 0.0


def _machine() -> tuple[float, float]:
    """Busy (user, nice, system, irq, softirq) and steal CPU seconds since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return busy / tick, fields[7] / tick


# ----------------------------------------------------------------------------- one scenario


def _infd(w: World, name: str) -> dict[str, Any]:
    return rest.get(w.kube.api, "infd", NS, name) or {}


def _pods(w: World, name: str) -> list[dict[str, Any]]:
    return rest.items(w.kube.api, "pods", NS, label_selector=f"ember.dev/instance={name}")


def _first_version_settled(w: World, sc: Scenario) -> bool:
    obj = _infd(w, sc.name)
    status = obj.get("status") or {}
    ready = rest.condition(obj, "Ready").get("status") == "True"
    current = status.get("observedGeneration") == obj.get("metadata", {}).get("generation")
    complete = not sc.rollout or (status.get("rollout") or {}).get("phase") == "Complete"
    serving = all(w.timeline.state(s) == "v1" for s in w.plan.sites)
    return ready and current and complete and serving and _staged(w, w.plan.files["v1"].sha256)


def _staged(w: World, sha: str) -> bool:
    """Every site's agent holds the file (its Node's cache label)."""
    query = [("labelSelector", f"{rs.BENCH_LABEL}=true,{cache_label(sha)}=true")]
    listed = rest.request(w.kube.api, "GET", "/api/v1/nodes", query=query)
    have = {n["metadata"]["labels"][rs.SITE_LABEL] for n in listed["items"]}
    return have >= set(w.plan.sites)


def _baseline_ready(w: World, name: str) -> bool:
    """The real sites' first-version replicas have reported enough requests for the gate."""
    done = set()
    for pod in _pods(w, name):
        site = w.site_of_node.get(pod["spec"].get("nodeName") or "")
        report = parse_health_condition((pod.get("status") or {}).get("conditions"))
        if site in w.plan.real_sites and report and report.requests >= GATE["minRequests"]:
            done.add(site)
    return done >= set(w.plan.real_sites)


def start_first_version(w: World, sc: Scenario) -> rs.Load:
    w.versions.v1_hashes, w.versions.new_kind = None, sc.change
    with w.log_lock:
        w.status_log.clear()
    rest.create(w.kube.api, "infd", NS, manifest(w.plan, sc))
    wait_for(f"{sc.name}: v1 everywhere", lambda: _first_version_settled(w, sc), 1200, 2)
    hashes = {p["metadata"]["annotations"].get(rs.CONFIG_HASH, "") for p in _pods(w, sc.name)}
    w.versions.freeze(hashes)
    load = rs.Load(w.plan.real_sites, w.kubelet.target, MODEL_NAME, w.args.period)
    load.start()
    wait_for(f"{sc.name}: the real replicas' baseline", lambda: _baseline_ready(w, sc.name), 180, 2)
    return load


class Outage:
    """One site of the second wave goes offline `LEAD_S` before its wave starts (5 s before the
    canary's bake ends; for the plain update: as the change is applied), so its wave finds it
    away, and comes back `outage_s` later; its agent is stopped meanwhile."""

    def __init__(self, w: World, sc: Scenario, t0: float) -> None:
        self.w, self.sc, self.t0 = w, sc, t0
        self.site = w.plan.offline_site
        self.away: float | None = None
        self.back: float | None = None
        self.phase_then: str | None = None  # the site's rollout phase when it went away
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        w = self.w
        if self.sc.rollout:
            canary = w.plan.sites[0]
            wait_for("the canary's bake", lambda: self._site_phase(canary) == "Baking", 900, 0.2)
            time.sleep(max(0.0, w.plan.canary_bake - LEAD_S))
        nodes = rs.node_names(self.site)
        self.phase_then = self._site_phase(self.site) if self.sc.rollout else None
        rs.take_offline(w.kube.api, nodes)
        w.agents.signal(self.site, signal.SIGSTOP)
        w.timeline.set_offline(self.site, True)
        self.away = time.time()
        time.sleep(w.plan.outage_s)
        rs.bring_back(w.kube.api, nodes)
        w.agents.signal(self.site, signal.SIGCONT)
        wait_for("the site's nodes back", lambda: rs.nodes_ready(w.kube.api, nodes), 120, 1)
        self._kubelet_back(nodes)
        w.timeline.set_offline(self.site, False)
        self.back = time.time()

    def _site_phase(self, name: str) -> str:
        """A site's phase in the last status written since the change."""
        with self.w.log_lock:
            since = [r for t, r in self.w.status_log if t >= self.t0]
        last = since[-1] if since else {}
        site: dict[str, Any] = next((s for s in last.get("sites", []) if s["name"] == name), {})
        return str(site.get("phase", "Pending"))

    def _kubelet_back(self, nodes: tuple[str, str]) -> None:
        """The returning kubelets report their running pods Ready again (the node lifecycle
        controller marked them not ready; kwok leaves a pod with an IP alone)."""
        now = rs.now_rfc3339()
        for pod in _pods(self.w, self.sc.name):
            here = pod["spec"].get("nodeName") in nodes and not rs.deleting(pod)
            if here and (pod.get("status") or {}).get("podIP"):
                conds = [rs.condition(k, True, now) for k in ("Ready", "ContainersReady")]
                name = pod["metadata"]["name"]
                rs.patch_status(self.w.kube.api, NS, name, {"conditions": conds})


def _all_changed(w: World) -> bool:
    """Every site serves the new version (Ready: good, or broken if it is the slow one)."""
    states = {w.timeline.state(s) for s in w.plan.sites}
    return states <= ({"new", rs.BROKEN} if w.versions.new_kind == "slow" else {"new"})


def _rollout_done(w: World, t0: float, outage: Outage | None) -> str | None:
    """Complete with every site serving the new version (an offline site back first), or
    rolled back with every site serving v1 again."""
    with w.log_lock:
        log = [r for t, r in w.status_log if t >= t0]
    phase = log[-1].get("phase") if log else None
    if outage is not None and outage.back is None:
        return None
    if phase == "Complete" and log[-1].get("updateRevision") != log[0].get("stableRevision"):
        return "Complete" if _all_changed(w) else None
    if phase == "RolledBack":
        serving = all(w.timeline.state(s) == "v1" for s in w.plan.sites)
        return "RolledBack" if serving else None
    return None


class PlainProgress:
    """When a plain rolling update is done: complete, or no change in its counts for `stall`
    seconds (nothing left will move without a person)."""

    def __init__(self, w: World, sc: Scenario, stall: float) -> None:
        self.w, self.sc, self.stall = w, sc, stall
        self.last: tuple[Any, ...] | None = None
        self.since = time.monotonic()

    def __call__(self, outage: Outage | None) -> str | None:
        dep = rest.get(self.w.kube.api, "deployments", NS, self.sc.name) or {}
        st, spec = dep.get("status") or {}, dep.get("spec") or {}
        counts = tuple(st.get(k, 0) for k in ("updatedReplicas", "readyReplicas", "replicas"))
        want = spec.get("replicas")
        current = st.get("observedGeneration", 0) >= dep.get("metadata", {}).get("generation", 1)
        if current and counts == (want, want, want) and _all_changed(self.w):
            return "Complete"
        if counts != self.last:
            self.last, self.since = counts, time.monotonic()
        waiting = outage is not None and outage.back is None
        if not waiting and time.monotonic() - self.since > self.stall:
            return f"stalled ({counts[0]}/{want} updated, {counts[1]} ready, no progress)"
        return None


def run_change(w: World, sc: Scenario, load: rs.Load) -> dict[str, Any]:
    before, cpu = w.origin.state.snapshot(), CpuAccount(w)
    w.timeline.mark()
    t0 = time.time()
    rest.merge_patch(w.kube.api, "infd", NS, sc.name, {"spec": change(w.plan, sc.change)})
    outage = Outage(w, sc, t0) if sc.offline else None
    if outage is not None:
        outage.thread.start()
    plain = PlainProgress(w, sc, w.args.stall)
    ended = wait_for(
        f"{sc.key}: the end",
        lambda: _rollout_done(w, t0, outage) if sc.rollout else plain(outage),
        w.args.timeout,
        1.0,
    )
    t_end = time.time()
    if outage is not None:
        outage.thread.join(w.plan.outage_s + 180)
    time.sleep(3)
    load.halt()
    return {
        "t0": t0,
        "t_end": t_end,
        "outcome": ended,
        "sent": load.take(),
        "wan": _delta(before, w.origin.state.snapshot()),
        "cpu_s": cpu.used(),
        "outage": None if outage is None else _outage(outage),
        "timeline": w.timeline.snapshot(),
        "ran_broken": w.timeline.ran(),
        "status_log": [(t, r) for t, r in list(w.status_log) if t >= t0 - 1],
    }


def _outage(outage: Outage) -> dict[str, Any]:
    return {
        "site": outage.site,
        "away": outage.away,
        "back": outage.back,
        "phase_then": outage.phase_then,
    }


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def remove(w: World, sc: Scenario) -> None:
    rest.delete(w.kube.api, "infd", NS, sc.name)
    wait_for(f"{sc.name}: gone", lambda: not _pods(w, sc.name) and not _infd(w, sc.name), 300, 2)


# ----------------------------------------------------------------------------- figures


def _round(value: float | None) -> float | None:
    return None if value is None else round(value)


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 1)


def phase_history(log: list[tuple[float, dict[str, Any]]], t0: float) -> dict[str, Any]:
    """Per site and per wave, each phase as first seen (seconds after the change)."""
    sites: dict[str, list[tuple[float, str, str | None]]] = {}
    waves: dict[str, list[tuple[float, str]]] = {}
    phases: list[tuple[float, str]] = []
    for t, rollout in log:
        rel = round(t - t0, 1)
        if not phases or phases[-1][1] != rollout.get("phase"):
            phases.append((rel, str(rollout.get("phase"))))
        for site in rollout.get("sites") or []:
            seen = sites.setdefault(site["name"], [])
            if not seen or seen[-1][1] != site["phase"]:
                seen.append((rel, site["phase"], site.get("reason")))
        for wave in rollout.get("waves") or []:
            seen_w = waves.setdefault(wave["name"], [])
            if not seen_w or seen_w[-1][1] != wave["phase"]:
                seen_w.append((rel, wave["phase"]))
    return {"sites": sites, "waves": waves, "phases": phases}


def _first(history: list[tuple[Any, ...]], phases: set[str]) -> float | None:
    return next((h[0] for h in history if h[1] in phases), None)


def wave_times(history: dict[str, Any], last: dict[str, Any]) -> list[dict[str, Any]]:
    """Each wave: when it started and ended, and its slowest site's stage, Ready and bake."""
    out = []
    for wave in last.get("waves") or []:
        seen = history["waves"].get(wave["name"], [])
        members = [s["name"] for s in last.get("sites") or [] if s["wave"] == wave["name"]]
        started = _first(seen, {"Progressing"})
        ended = _first(seen, {"Passed", "Failed", "RolledBack"})
        steps = [_site_steps(history["sites"].get(m, [])) for m in members]
        out.append(
            {
                "wave": wave["name"],
                "sites": wave.get("sites", len(members)),
                "phase": wave["phase"],
                "started_s": started,
                "ended_s": ended,
                "duration_s": None
                if started is None or ended is None
                else round(ended - started, 1),
                **{k: _max(st.get(k) for st in steps) for k in ("stage_s", "ready_s", "bake_s")},
            }
        )
    return out


def _site_steps(seen: list[tuple[float, str, str | None]]) -> dict[str, float | None]:
    staging, updating = _first(seen, {"Staging"}), _first(seen, {"Updating"})
    baking, passed = _first(seen, {"Baking"}), _first(seen, {"Passed"})
    return {
        "stage_s": _span(staging, updating),
        "ready_s": _span(updating, baking),
        "bake_s": _span(baking, passed),
    }


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def _max(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def time_in(history: list[tuple[float, str]], state: str, t0: float, t1: float) -> float:
    """Seconds a site spent in `state` between t0 and t1."""
    total = 0.0
    for (t, s), nxt in zip(history, [*history[1:], (t1, "")], strict=True):
        start, end = max(t, t0), min(nxt[0], t1)
        if s == state and end > start:
            total += end - start
    return round(total, 1)


def site_figures(raw: dict[str, Any], sites: list[str]) -> dict[str, Any]:
    """The sites the change hurt (the deployment failure rate's numerator): those that ran the
    broken version at all, served it (or nothing in its place), or were left without a Ready
    replica; how long each served it; sites down (nothing Ready) and for how long."""
    t0, t1, tl = raw["t0"], raw["t_end"], raw["timeline"]
    broken = {s: time_in(tl.get(s, []), rs.BROKEN, t0, t1) for s in sites}
    down = {s: time_in(tl.get(s, []), rs.DOWN, t0, t1) for s in sites}
    ever = sorted(s for s in sites if any(st == rs.BROKEN for _, st in tl.get(s, [])))
    end = {s: (tl.get(s) or [(0.0, "?")])[-1][1] for s in sites}
    left_down = sorted(s for s in sites if end[s] == rs.DOWN)
    affected = sorted(set(ever) | set(raw["ran_broken"]) | set(left_down))
    return {
        "sites_affected": affected,
        "failure_rate": round(len(affected) / len(sites), 4),
        "sites_ran_broken": {s: round(t - t0, 1) for s, t in sorted(raw["ran_broken"].items())},
        "sites_left_down": left_down,
        "sites_broken": ever,
        "broken_share": round(len(ever) / len(sites), 4),
        "broken_site_seconds": round(sum(broken.values()), 1),
        "broken_seconds": {s: v for s, v in broken.items() if v},
        "broken_at_end": sorted(s for s in ever if end[s] == rs.BROKEN),
        "down_site_seconds": round(sum(down.values()), 1),
        "down_seconds": {s: v for s, v in down.items() if v},
        "state_at_end": {k: sum(v == k for v in end.values()) for k in sorted(set(end.values()))},
    }


def client_figures(sent: list[rs.Sent], warm: list[rs.Sent]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for site in sorted({x.site for x in sent}):
        mine = [x for x in sent if x.site == site]
        ttft = {
            v: _pcts([x.ttft_ms for x in mine if x.version == v and x.ttft_ms is not None])
            for v in ("v1", "new")
        }
        base = [x.ttft_ms for x in warm if x.site == site and x.ttft_ms is not None]
        out[site] = {
            **{k: sum(x.outcome == k for x in mine) for k in ("ok", "failed", "unserved")},
            "ttft_ms": ttft | {"v1_before_change": _pcts(base)},
            "failures": [x.detail for x in mine if x.outcome == "failed"][:5],
        }
    return out


def _pcts(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"n": len(values), "p50": round(statistics.median(ordered)), "p99": round(p99)}


def rollback_figures(history: dict[str, Any], raw: dict[str, Any], sites: list[str]) -> Any:
    """A failed gate: when the site failed, when status said RolledBack, when every site that
    had changed served the first version again."""
    failed = [(_first(h, {"Failed"}), s) for s, h in history["sites"].items()]
    failed = [(t, s) for t, s in failed if t is not None]
    if not failed:
        return None
    t_fail, site = min(failed)
    t_rb = _first(history["phases"], {"RolledBack"})
    t0, tl = raw["t0"], raw["timeline"]
    changed = [s for s in sites if any(st != "v1" for _, st in tl.get(s, []))]
    back = [_back_on_v1(tl.get(s, []), t0 + t_fail) for s in changed]
    known = [x for x in back if x is not None]
    done = round(max(known) - t0 - t_fail, 1) if known and len(known) == len(back) else None
    reason = next(h[2] for h in history["sites"][site] if h[1] == "Failed")
    return {
        "failed_site": site,
        "reason": reason,
        "failed_at_s": t_fail,
        "rolled_back_at_s": t_rb,
        "serving_v1_again_after_failure_s": done,
    }


def _back_on_v1(history: list[tuple[float, str]], since: float) -> float | None:
    return next((t for t, st in history if t >= since and st == "v1"), None)


def summarize(w: World, sc: Scenario, raw: dict[str, Any], warm: list[rs.Sent]) -> dict[str, Any]:
    t0, sites = raw["t0"], w.plan.sites
    out: dict[str, Any] = {
        "key": sc.key,
        "mode": "rollout" if sc.rollout else "plain rolling update",
        "change": sc.change,
        "title": TITLES[sc.change],
        "offline": sc.offline,
        "outcome": raw["outcome"],
        "duration_s": round(raw["t_end"] - t0, 1),
        "cpu_s": raw["cpu_s"],
        "wan_bytes": raw["wan"],
        "clients": client_figures(raw["sent"], warm),
        **site_figures(raw, sites),
        "timeline": {
            s: [(round(t - t0, 1), st) for t, st in h] for s, h in raw["timeline"].items()
        },
        "requests": [
            (round(x.t - t0, 2), x.site, x.outcome, x.version, _round(x.ttft_ms))
            for x in raw["sent"]
        ],
    }
    if raw["outage"]:
        o = raw["outage"]
        out["outage"] = {
            "site": o["site"],
            "away_s": _rel(o["away"], t0),
            "back_s": _rel(o["back"], t0),
            "phase_then": o["phase_then"],
        }
    if sc.rollout and raw["status_log"]:
        history = phase_history(raw["status_log"], t0)
        last = raw["status_log"][-1][1]
        out["waves"] = wave_times(history, last)
        out["rollout_phases"] = history["phases"]
        out["site_phases"] = history["sites"]
        out["rollback"] = rollback_figures(history, raw, sites)
        out["final_sites"] = {s["name"]: [s["phase"], s.get("reason")] for s in last["sites"]}
    return out


def run_scenario(w: World, sc: Scenario) -> dict[str, Any]:
    print(f"=== {sc.key}: {TITLES[sc.change]} ({'rollout' if sc.rollout else 'plain'})", flush=True)
    loads: list[rs.Load] = []
    try:
        loads.append(start_first_version(w, sc))
        warm = loads[0].take()
        raw = run_change(w, sc, loads[0])
        return summarize(w, sc, raw, warm)
    except (TimeoutError, ApiException, OSError) as exc:
        print(f"{sc.key}: {exc!r}", file=sys.stderr)
        return {"key": sc.key, "change": sc.change, "error": repr(exc)}
    finally:
        for load in loads:
            load.halt()
        _clean_up(w, sc)


def _clean_up(w: World, sc: Scenario) -> None:
    """The object gone and, after a drill that failed half-way, its offline site back."""
    try:
        if sc.offline:
            nodes = rs.node_names(w.plan.offline_site)
            rs.bring_back(w.kube.api, nodes)
            w.agents.signal(w.plan.offline_site, signal.SIGCONT)
            w.timeline.set_offline(w.plan.offline_site, False)
            wait_for("the offline site back", lambda: rs.nodes_ready(w.kube.api, nodes), 120, 1)
        remove(w, sc)
    except (TimeoutError, ApiException, OSError) as exc:
        print(f"{sc.key}: clean-up: {exc!r}", file=sys.stderr)


# ----------------------------------------------------------------------------- report


def _s(value: Any) -> str:
    return "-" if value is None else str(value)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def wan_line(run: dict[str, Any], sites: list[str], files: dict[str, Any]) -> str:
    wan = run.get("wan_bytes") or {}
    per_site = [wan.get(s, 0) for s in sites]
    fetched = [b for b in per_site if b]
    other = {k: v for k, v in wan.items() if k not in sites}
    size = (
        files["v2" if run["change"] == "good" else "bad"]["size"] if run["change"] != "slow" else 0
    )
    median = int(statistics.median(fetched)) if fetched else 0
    text = (
        f"WAN (origin) bytes: {_mb(sum(wan.values()))} MB in all; {len(fetched)} sites fetched"
        f" (per fetching site: min {_mb(min(fetched, default=0))}, median {_mb(median)}, max "
        f"{_mb(max(fetched, default=0))} MB; the new file is {_mb(size)} MB)"
    )
    return text + (f"; not attributed to a site: {other}" if other else "") + "."


def wave_table(run: dict[str, Any]) -> list[str]:
    rows = [
        "| wave | sites | phase | started (s) | ended (s) | took (s) | slowest stage (s) | "
        "slowest Ready (s) | bake (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for wv in run.get("waves") or []:
        cells = [wv["wave"], wv["sites"], wv["phase"], wv["started_s"], wv["ended_s"]]
        cells += [wv["duration_s"], wv["stage_s"], wv["ready_s"], wv["bake_s"]]
        rows.append("| " + " | ".join(_s(c) for c in cells) + " |")
    return rows


def client_table(run: dict[str, Any], canary: str) -> list[str]:
    rows = [
        "| real site | ok | failed | unserved (no Ready replica) | TTFT v1 p50/p99 (ms) | "
        "TTFT new p50/p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for site, c in sorted(run.get("clients", {}).items()):
        v1 = c["ttft_ms"].get("v1") or c["ttft_ms"].get("v1_before_change")
        new = c["ttft_ms"].get("new")
        label = f"{site} ({'canary' if site == canary else 'later wave'})"
        cells = [label, c["ok"], c["failed"], c["unserved"], _pair(v1), _pair(new)]
        rows.append("| " + " | ".join(_s(x) for x in cells) + " |")
    return rows


def _pair(p: dict[str, float] | None) -> str:
    return "-" if not p else f"{p['p50']:.0f} / {p['p99']:.0f} (n={p['n']})"


def _few(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return (", ".join(items[:limit]) + more) if items else "none"


def broken_line(run: dict[str, Any], total: int) -> str:
    ran = [f"{s} (from {t} s)" for s, t in run.get("sites_ran_broken", {}).items()]
    secs = run.get("broken_seconds", {})
    served = [f"{s} {secs.get(s, 0)} s" for s in run.get("sites_broken", [])]
    still = run.get("broken_at_end", [])
    tail = f" ({len(still)} still at the end)" if still else ""
    return (
        f"Sites the change hurt: {len(run.get('sites_affected', []))}/{total} "
        f"({100 * run.get('failure_rate', 0):.0f} %). Ran the broken version: {_few(ran)}. "
        f"Served it, or nothing in its place: {_few(served)}{tail}. Left without a Ready "
        f"replica: {_few(run.get('sites_left_down', []))}. Site-seconds with no Ready replica "
        f"(every changeover, maxSurge 0, included): {run.get('down_site_seconds', 0)}."
    )


def scenario_section(run: dict[str, Any], result: dict[str, Any]) -> list[str]:
    sites, canary = result["sites"], result["sites"][0]
    head = f"### {run['key']}: {run.get('title', run['change'])} — {run.get('mode', '')}"
    if "error" in run:
        return [head, "", f"Did not finish: `{run['error']}`.", ""]
    steal = run["cpu_s"].get("machine steal")
    phases = run.get("rollout_phases") or []
    status = f"; status.rollout: {_phase_line(phases)}" if phases else ""
    lines = [head, "", f"Outcome: **{run['outcome']}** after {run['duration_s']} s{status} "
             f"(steal during it: {steal} CPU s).", ""]  # fmt: skip
    lines += [*wave_table(run), ""] if run.get("waves") else []
    rb = run.get("rollback")
    if rb:
        lines.append(
            f"Rollback: {rb['failed_site']} failed its gate ({rb['reason']}) at "
            f"{rb['failed_at_s']} s; status RolledBack at {rb['rolled_back_at_s']} s; every "
            f"changed site served v1 again {rb['serving_v1_again_after_failure_s']} s after the "
            "failure (its files were still in the site cache: no WAN bytes)."
        )
    if run.get("outage"):
        o = run["outage"]
        then = f" (it was {o['phase_then']} then)" if o.get("phase_then") else ""
        lines.append(f"Offline: {o['site']} from {o['away_s']} s to {o['back_s']} s{then}.")
    lines += [wan_line(run, sites, result["files"]), broken_line(run, len(sites)), ""]
    lines += [*client_table(run, canary), ""]
    return lines


def _phase_line(phases: list[tuple[float, str]]) -> str:
    return " → ".join(f"{p} at {t} s" for t, p in phases)


def comparison(result: dict[str, Any]) -> list[str]:
    runs = {r["key"]: r for r in result["runs"]}
    rows = [
        "| change | how | outcome | time (s) | sites hurt (failure rate) | ran the broken "
        "version | left without a replica | served it or nothing (site-s) | no Ready replica, "
        "all causes (site-s) | WAN MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ("a", "plain-a", "b", "plain-b", "c", "plain-c", "d-halt", "d-skip", "plain-d"):
        run = runs.get(key)
        if run is None or "error" in run:
            continue
        how = run["mode"] + (f", {run['offline']}" if run.get("offline") else "")
        share = f"{len(run['sites_affected'])} ({100 * run['failure_rate']:.0f} %)"
        cells = [TITLES[run["change"]], how, run["outcome"], run["duration_s"], share]
        cells += [len(run["sites_ran_broken"]), len(run["sites_left_down"])]
        cells += [run["broken_site_seconds"], run["down_site_seconds"]]
        cells.append(_mb(sum((run.get("wan_bytes") or {}).values())))
        rows.append("| " + " | ".join(_s(c) for c in cells) + " |")
    return rows


def cpu_table(result: dict[str, Any]) -> list[str]:
    runs = [r for r in result["runs"] if "cpu_s" in r]
    if not runs:
        return []
    names = list(runs[0]["cpu_s"])
    rows = [
        "| scenario | s | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for run in runs:
        cells = [run["key"], run["duration_s"], *(run["cpu_s"].get(n, "-") for n in names)]
        rows.append("| " + " | ".join(_s(c) for c in cells) + " |")
    return rows


def markdown(result: dict[str, Any]) -> str:
    f, facts = result["files"], result["facts"]
    relay = facts.get("bad_version_exit", {})
    lines = [
        "# Site-by-site rollout vs a plain rolling update",
        "",
        f"{len(result['sites'])} sites × 2 kwok nodes, one replica per site, Gemma 3 270M "
        f"(Q4_K_M, {_mb(f['v1']['size'])} MB) over http from a counting origin on loopback. "
        f"{result['cpus']} CPUs; load average before {result['loadavg_before']}, after "
        f"{result['loadavg_after']}; steal {result['steal_s']} CPU s over the whole run; "
        f"{result['when']}; the run took {result['wall_s']:.0f} s.",
        "",
        f"Command: `{result['command']}` (run alone: under `flock /tmp/ember-cpu.lock`).",
        "",
        "## What is real, what is emulated",
        "",
        *_real_lines(result),
        "",
        "## Set-up",
        "",
        *_setup_lines(result),
        "",
        "## Against a plain rolling update",
        "",
        "A site the change hurt ran the broken version (a replica of the version that does not "
        "load bound there, or a Ready replica of the slow one), served it or nothing in its "
        "place, or was left without a Ready replica: their share is the field report's "
        "deployment failure rate. A plain update never rolls back by itself: what it broke "
        "stays broken until a person acts (its observation ends when it completes, or after "
        "60 s without progress).",
        "",
        *comparison(result),
        "",
        "The plain updates ran after the rollouts, so the sites' caches already held the new "
        "files (WAN 0 there; a plain update fetches on every site as its pods land). kwok "
        "replicas are Ready at once (no prewarm, no model load): the plain updates' times are "
        "lower bounds; the two real replicas took a few seconds each to load.",
        "",
        "## Each scenario",
        "",
    ]
    for run in result["runs"]:
        lines += scenario_section(run, result)
    lines += [
        "## Where the CPU went",
        "",
        "CPU seconds by process from each change to its end (2 cores: at most 2 CPU s a "
        "second). The node agents are in one cgroup with "
        f"cpu.shares {result['facts'].get('agent_cpu_shares') or 'unset'} (a root-level process "
        "has 1024): on a fleet they run on the other sites' machines, not on the real "
        "replicas' cores.",
        "",
        *cpu_table(result),
        "",
    ]
    lines += [
        "Exit of the real runtime on the truncated file (relayed to the kwok replicas of that "
        f"version): exit code {relay.get('exit_code')}, message (as the kubelet reports it, "
        "FallbackToLogsOnError):",
        "",
        "```",
        *str(relay.get("message", ""))[-600:].splitlines(),
        "```",
    ]
    return "\n".join(lines) + "\n"


def _real_lines(result: dict[str, Any]) -> list[str]:
    facts, plan = result["facts"], result["plan"]
    agents = facts.get("agents", {})
    return [
        "- Real: etcd, kube-apiserver, controller-manager (Deployment, ReplicaSet, node "
        "lifecycle), scheduler; the operator (`python -m ember_operator`, its own process); "
        f"node agents (`python -m ember_runtime.nodeagent`): {agents.get('real_processes')} "
        f"processes for {agents.get('real_sites')} sites (one per site on its first node, both "
        "nodes at the real replicas' sites), with tokens bound to pods on their nodes through "
        "the chart's RBAC and admission policies, site sharing on (site Leases); they fetch from "
        f"the origin and label their Nodes; {agents.get('emulated_sites')} sites emulated "
        f"(download once, check sha256, label). Agents' RSS in all: {agents.get('rss_mib_total')} "
        "MiB.",
        f"- Real replicas: {len(plan['real_sites'])} ({', '.join(plan['real_sites'])}: the canary "
        "and one site of the second wave), each `python -m ember_runtime.server` started by the "
        "bench for the pod the Deployment made, on the ConfigMap the operator rendered for it "
        "(node-local paths changed), the model as a view of its site agent's cached file "
        "(prewarm itself not run), the pod's identity (a token bound to it: it writes its own "
        "`ember.dev/Health`, window 60 s), the pod's CPU limit as a CFS quota (cgroup v1 "
        f"{'on' if result['facts'].get('cgroups') else 'unavailable: no quota'}), 1 llama.cpp "
        f"thread as rendered from the {V1_CPU}-CPU limit (two replicas of two threads each "
        "oversubscribe two cores: llama.cpp's spinning threads then made v1 slower than one "
        "thread). The bench plays their kubelet: Ready "
        "when /readyz answers; an exit relayed as termination message (or log tail).",
        "- Emulated: the other replicas are kwok pods (the bench's own kwok process): Ready at "
        f"once; a synthetic `ember.dev/Health` (30 requests, 0 errors, TTFT p99 "
        f"{rs.SYNTHETIC_TTFT_MS} ms, × {plan['slow_ratio_synthetic']} for the slow version); for "
        "the version that does not load, the real runtime's own exit (run once on that file) "
        "written as their kubelet would. Offline = kwok stops reporting the site's nodes Ready "
        "(a label its node stage skips; it still renews their Leases), their Ready turns "
        "Unknown as the node lifecycle controller writes it when a kubelet stops posting (the "
        "controller then taints them unreachable and marks their pods not ready), and the "
        "site's agent is SIGSTOPped; back = kwok reports them Ready again and the bench "
        "reports their pods Ready again, as the returning kubelets would.",
        f"- Client load: {1 / result['period_s']:.1f} requests/s per real site (streamed "
        "completions, an 80-word prompt of random words, 4 tokens), to the site's Ready "
        "replica (as a Service routes); loopback only. kwok sites serve no requests.",
        f"- Time is not compressed, except the bake times ({plan['canary_bake']} s for the "
        f"canary, {plan['bake']} s after) and `unreachableAfterSeconds` ({UNREACHABLE_AFTER_S} s).",
    ]


def _setup_lines(result: dict[str, Any]) -> list[str]:
    plan, f = result["plan"], result["files"]
    agents = result["facts"].get("agents", {})
    return [
        f"- Waves: canary = {plan['sites'][0]} (explicit); {RING} = the sites whose nodes carry "
        f"`{rs.RING_LABEL}={RING}` ({', '.join(plan['ring'])}: 10 %, a selector wave); then "
        "`rest` (the planner's last wave). Gate: "
        + ", ".join(f"{k} {v}" for k, v in GATE.items())
        + f"; unreachableAfterSeconds {UNREACHABLE_AFTER_S}.",
        f"- v1: `{f['v1']['sha256'][:12]}…` ({_mb(f['v1']['size'])} MB), CPU limit {V1_CPU}. Good "
        f"version: `{f['v2']['sha256'][:12]}…` (the same weights + {PAD_BYTES} bytes; "
        f"{_mb(f['v2']['size'])} MB). Does not load: `{f['bad']['sha256'][:12]}…` (the first "
        f"{BAD_BYTES >> 20} MiB). Slow: CPU limit {SLOW_CPU} (its CFS quota); "
        f"measured first-token ratio on the real replicas: {_s(result.get('slow_ratio'))}.",
        f"- Offline site for d: {plan['offline_site']} (second wave), away {plan['outage_s']} s "
        f"from {LEAD_S:.0f} s before its wave starts (plain: from the change).",
        f"- First version onto every site at set-up: {agents.get('first_version_on_every_site_s')}"
        f" s, {_mb(agents.get('first_version_wan_bytes', 0))} MB from the origin.",
    ]


def slow_ratio(runs: list[dict[str, Any]], canary: str) -> float | None:
    """The real replicas' first token, slow version over v1 (p50s, same site, same run)."""
    for run in runs:
        if run.get("change") != "slow" or "error" in run:
            continue
        for site, c in run["clients"].items():
            base, new = c["ttft_ms"].get("v1_before_change"), c["ttft_ms"].get("new")
            if base and new and (site == canary or not run.get("waves")):
                return round(float(new["p50"]) / float(base["p50"]), 2)
    return None


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["key"]: r for r in result["runs"] if "error" not in r}
    grid = [["a", "plain-a", None], ["b", "plain-b", None], ["c", "plain-c", None]]
    grid.append(["d-halt", "d-skip", "plain-d"])
    fig, axes = plt.subplots(4, 3, figsize=(15, 13), squeeze=False)
    for row, keys in zip(axes, grid, strict=True):
        span = max((runs[k]["duration_s"] for k in keys if k in runs), default=1.0)
        for ax, key in zip(row, keys, strict=True):
            run = runs.get(key) if key else None
            if run is None:
                ax.axis("off")
                continue
            _stack(ax, run, len(result["sites"]))
            ax.set_xlim(0, span)
    handles, labels = next(
        (ax.get_legend_handles_labels() for ax in axes.flat if ax.get_legend_handles_labels()[0]),
        ([], []),
    )
    fig.legend(handles, labels, loc="upper right", fontsize=9)
    fig.suptitle("Sites by what they serve, from the change (s): rollout vs plain rolling update")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _stack(ax: Any, run: dict[str, Any], total: int) -> None:
    end = run["duration_s"]
    times = [i * end / 300 for i in range(301)]
    states = list(COLORS)
    counts = {s: [0] * len(times) for s in states}
    for history in run["timeline"].values():
        for i, t in enumerate(times):
            now = next((st for ts, st in reversed(history) if ts <= t), history[0][1])
            counts[now][i] += 1
    ax.stackplot(times, *[counts[s] for s in states], labels=states,
                 colors=[COLORS[s] for s in states])  # fmt: skip
    ax.set_ylim(0, total)
    ax.set_title(
        f"{run['key']}: {run['mode']}, {run['change']} → {run['outcome'][:30]}", fontsize=9
    )
    ax.set_xlabel("s after the change", fontsize=8)


# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sites", type=int, default=50)
    p.add_argument("--only", default=",".join(SCENARIOS))
    p.add_argument("--real-agents", type=int, default=50, help="sites with a real agent process")
    p.add_argument("--canary-bake", type=int, default=30)
    p.add_argument("--bake", type=int, default=20)
    p.add_argument("--outage", type=float, default=90.0, help="seconds the offline site is away")
    p.add_argument("--period", type=float, default=1.5, help="seconds between requests a site")
    p.add_argument("--stall", type=float, default=60.0, help="a plain update with no progress")
    p.add_argument("--timeout", type=float, default=1200.0, help="per scenario, after the change")
    p.add_argument("--work", default="/tmp/ember-rollout-bench")
    p.add_argument("--keep", action="store_true", help="keep the agents' caches")
    p.add_argument("--agent-shares", type=int, default=128, help="agents' cpu.shares; 0: off")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="rollout")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    sites = [rs.site_name(i) for i in range(args.sites)]
    plan = Plan(sites, [], "", args.canary_bake, args.bake, args.outage)
    ring = plan.ring
    if len(ring) < 2:
        raise SystemExit("--sites must give the second wave two sites at least (>= 20)")
    plan.real_sites, plan.offline_site = [sites[0], ring[-1]], ring[0]
    return plan


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    plan = make_plan(args)
    keys = [k for k in args.only.split(",") if k]
    unknown = set(keys) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {list(SCENARIOS)}")
    shutil.rmtree(args.work, ignore_errors=True)
    Path(args.work).mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_before, steal0 = time.monotonic(), os.getloadavg(), steal_seconds()
    w = World(plan, args)
    runs: list[dict[str, Any]] = []
    try:
        w.setup()
        w.facts["cgroups"] = w.kubelet.cgroups
        runs = [run_scenario(w, SCENARIOS[k]) for k in keys]
    finally:
        w.close()
    result = {
        "sites": plan.sites,
        "plan": {
            "sites": plan.sites,
            "ring": plan.ring,
            "real_sites": plan.real_sites,
            "offline_site": plan.offline_site,
            "canary_bake": plan.canary_bake,
            "bake": plan.bake,
            "outage_s": plan.outage_s,
            "slow_ratio_synthetic": 3.0,
        },
        "gate": GATE,
        "files": {k: {"sha256": f.sha256, "size": f.size} for k, f in plan.files.items()},
        "facts": w.facts,
        "runs": runs,
        "slow_ratio": slow_ratio(runs, plan.sites[0]),
        "period_s": args.period,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "steal_s": round(steal_seconds() - steal0, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([".venv/bin/python -m bench.rollout_bench", *(argv or sys.argv[1:])]),
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=_json) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(result))
    plot(result, args.out / f"{args.name}.png")
    print(markdown(result))
    return result


def _json(value: Any) -> Any:
    if isinstance(value, rs.Sent):
        return vars(value)
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(type(value).__name__)


if __name__ == "__main__":
    main()
    sys.exit(0)
