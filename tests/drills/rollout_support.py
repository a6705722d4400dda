"""The machinery of the site-rollout drill (`bench/rollout_bench.py`): a fleet of kwok sites on
the local control plane, a counting model origin, node agents, the kubelet's part for the pods
kwok does not run, a client load on the real replicas, and a per-site timeline.

- **Sites**: 2 Nodes a site, managed by a kwok process of the bench's own (`BenchKwok`), which
  manages only Nodes annotated `kwok.x-k8s.io/node=rollout-bench` (the cluster's own kwok
  leaves them alone). Its pod stage is kwok's `pod-ready` with two more conditions: pods on the
  nodes of the sites whose replicas are real processes, and pods of a model version that cannot
  load, are left to the bench (`Kubelet`), which writes what their kubelet would. Everything
  else about a Node (heartbeats, its Lease) and a pod's deletion is kwok's.
- **Origin** (`CountingOrigin`): serves the model files over loopback HTTP with Range, and
  counts the bytes it sends per site: each connection's client is traced to its process
  (/proc/net/tcp, then the agents' open sockets), so a node agent's bytes count for its site.
- **Node agents**: the real `python -m ember_runtime.nodeagent`, one per site on its first node,
  with a token bound to a pod on that node, through the chart's RBAC and admission policies
  (`tests/nodeagent/site_support.SiteWorld`); or, for sites beyond `real`, an emulated agent
  (`EmulatedAgent`) that downloads each wanted file once from the same origin, checks its
  sha256, keeps nothing on disk, and labels its Node as the agent does.
- **Kubelet** (`Kubelet`): for a pod on a real site's nodes, the real runtime server
  (`python -m ember_runtime.server`) on the ConfigMap the operator rendered for the pod, with the
  pod's identity (a token bound to it), under a CFS quota of the pod's CPU limit, loading the
  model from its site agent's cache; Ready when its /readyz answers, or its exit relayed as the
  kubelet does (termination message, else the log's tail: FallbackToLogsOnError). For kwok
  pods: a version that does not load gets the failure the real runtime reported; the others
  get a synthetic `ember.dev/Health` report once Ready.
- **Load** and **Timeline**: requests to the real replicas (loopback), and each site's state
  (which version it serves, broken, down, offline) as it changes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml
from ember_operator.apply import request
from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL, cache_label
from ember_runtime.contract.config import fetch_from_spec
from ember_runtime.contract.rollout import (
    HealthReport,
    health_condition,
    stable_model,
    stage_requests,
)
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.fleet import SIM_TAINT, node_manifest
from tests.conftest import Kube
from tests.nodeagent.site_support import TRUSTED_SITE_LABEL, SiteWorld, claim_metadata
from tests.support.net import free_port
from tests.support.waiting import poll, wait_for
from tests.thermal.kube_support import api_server

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_VALUE = "rollout-bench"
SITE_LABEL = "ember.dev/site"
RING_LABEL = "bench.ember.dev/ring"
BENCH_LABEL = "bench.ember.dev/rollout"
CONFIG_HASH = "ember.dev/config-hash"
POD_SELECTOR = "app.kubernetes.io/name=ember"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
RUNTIME_SA = "ember-runtime"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
CGROUP_PREFIX = "ember-rollout-"  # one cgroup a real replica, one for all the agents
LOG_TAIL_BYTES, LOG_TAIL_LINES = 2048, 80  # the kubelet's FallbackToLogsOnError
SYNTHETIC_TTFT_MS = 300
HEALTH_WINDOW_S = 60

OFFLINE_LABEL = "bench.ember.dev/offline"  # kwok leaves a Node so labelled alone
# kwok v0.7.0's own stages (kustomize/stage/{pod,node}/fast), the status templates verbatim; the
# bench adds the last two conditions to pod-ready and the offline label to node-initialize.
NODE_INIT_TEMPLATE = """\
{{ $now := Now }}
{{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $lastTransitionTime | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type  | Quote}}
{{ end }}
addresses:
{{ with .status.addresses }}
{{ YAML . 1 }}
{{ else }}
{{ with NodeIP }}
- address: {{ . | Quote }}
  type: InternalIP
{{ end }}
{{ with NodeName }}
- address: {{ . | Quote }}
  type: Hostname
{{ end }}
{{ end }}
{{ with NodePort }}
daemonEndpoints:
  kubeletEndpoint:
    Port: {{ . }}
{{ end }}
allocatable:
{{ with .status.allocatable }}
{{ YAML . 1 }}
{{ else }}
  cpu: 1k
  memory: 1Ti
  pods: 1M
{{ end }}
capacity:
{{ with .status.capacity }}
{{ YAML . 1 }}
{{ else }}
  cpu: 1k
  memory: 1Ti
  pods: 1M
{{ end }}
{{ $nodeInfo := .status.nodeInfo }}
{{ $kwokVersion := printf "kwok-%s" Version }}
nodeInfo:
  architecture: {{ or $nodeInfo.architecture "amd64" }}
  bootID: {{ or $nodeInfo.bootID `""` }}
  containerRuntimeVersion: {{ or $nodeInfo.containerRuntimeVersion $kwokVersion }}
  kernelVersion: {{ or $nodeInfo.kernelVersion $kwokVersion }}
  kubeProxyVersion: {{ or $nodeInfo.kubeProxyVersion $kwokVersion }}
  kubeletVersion: {{ or $nodeInfo.kubeletVersion $kwokVersion }}
  machineID: {{ or $nodeInfo.machineID `""` }}
  operatingSystem: {{ or $nodeInfo.operatingSystem "linux" }}
  osImage: {{ or $nodeInfo.osImage `""` }}
  systemUUID: {{ or $nodeInfo.systemUUID `""` }}
phase: Running
"""
POD_READY_TEMPLATE = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: ContainersReady
{{ range .spec.readinessGates }}
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: {{ .conditionType | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  state:
    terminated:
      exitCode: 0
      finishedAt: {{ $now | Quote }}
      reason: Completed
      startedAt: {{ $now | Quote }}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def site_name(i: int) -> str:
    return f"site-{i:02d}"


def node_names(site: str) -> tuple[str, str]:
    return f"rb-{site}-a", f"rb-{site}-b"


def patch_status(api: ApiClient, ns: str, pod: str, status: dict[str, Any]) -> None:
    """A pod status write, as the kubelet makes it (strategic merge: lists by name/type)."""
    path = f"/api/v1/namespaces/{ns}/pods/{pod}/status"
    with contextlib.suppress(ApiException):  # a pod gone meanwhile needs no status
        request(api, "PATCH", path, body={"status": status}, content_type=STRATEGIC, timeout=10)


def condition(kind: str, ok: bool, now: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": now}


# ----------------------------------------------------------------------------- kwok and nodes


def kwok_stages(real_nodes: Iterable[str], broken_fetch_hashes: Iterable[str]) -> str:
    """kwok's pod-ready (minus the real sites' nodes and the versions that do not load),
    pod-delete and node-initialize (minus offline nodes), as one config file. No node heartbeat
    stage: kwok renews each Node's Lease, which is what the node lifecycle controller reads; a
    delayed heartbeat would write Ready back onto a node taken offline."""
    ready = {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": "pod-ready"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": ".status.podIP", "operator": "DoesNotExist"},
                    {"key": ".spec.nodeName", "operator": "NotIn", "values": sorted(real_nodes)},
                    {
                        "key": f'.metadata.annotations["{FETCH_HASH_ANNOTATION}"]',
                        "operator": "NotIn",
                        "values": sorted(broken_fetch_hashes),
                    },
                ]
            },
            "next": {"statusTemplate": POD_READY_TEMPLATE},
        },
    }
    delete = {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": "pod-delete"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}]
            },
            "next": {"finalizers": {"empty": True}, "delete": True},
        },
    }
    init = {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": "node-initialize"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Node"},
            "selector": {
                "matchExpressions": [
                    {
                        "key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
                        "operator": "NotIn",
                        "values": ["True"],
                    },
                    {"key": f'.metadata.labels["{OFFLINE_LABEL}"]', "operator": "DoesNotExist"},
                ]
            },
            "next": {"statusTemplate": NODE_INIT_TEMPLATE},
        },
    }
    return yaml.safe_dump_all([ready, delete, init], sort_keys=False)


class BenchKwok:
    """The bench's own kwok process: its Nodes only (annotation value `KWOK_VALUE`)."""

    def __init__(self, kwok: Path, kubeconfig: Path, config: Path, log: Path) -> None:
        argv = [
            str(kwok),
            f"--kubeconfig={kubeconfig}",
            f"--config={config}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_VALUE}",
            "--cidr=10.251.0.0/16",
            "--node-ip=10.249.0.2",
            f"--server-address=127.0.0.1:{free_port()}",
            "--node-lease-duration-seconds=40",
        ]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)


def site_node(name: str, site: str, ring: str) -> dict[str, Any]:
    """A kwok Node of one site (the cluster fleet's shape, but this bench's kwok, no fleet
    label: another test's fleet cleanup never takes it), with the site label the agents trust
    and an InternalIP on loopback (the agents' peer address)."""
    body = node_manifest(name, "")
    meta = body["metadata"]
    meta["annotations"][KWOK_ANNOTATION] = KWOK_VALUE
    meta["labels"] = {
        k: v for k, v in meta["labels"].items() if k not in ("ember.dev/fleet", "type")
    }
    meta["labels"].update(
        {SITE_LABEL: site, TRUSTED_SITE_LABEL: site, RING_LABEL: ring, BENCH_LABEL: "true"}
    )
    body["spec"] = {"taints": [SIM_TAINT]}
    body["status"]["addresses"] = [
        {"type": "InternalIP", "address": "127.0.0.1"},
        {"type": "Hostname", "address": name},
    ]
    return body


def create_nodes(api: ApiClient, bodies: list[dict[str, Any]]) -> None:
    def create(body: dict[str, Any]) -> None:
        try:
            request(api, "POST", "/api/v1/nodes", body=body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, bodies))


def delete_nodes(api: ApiClient) -> None:
    query = [("labelSelector", f"{BENCH_LABEL}=true")]
    with contextlib.suppress(ApiException):
        request(api, "DELETE", "/api/v1/nodes", query=query, timeout=60)


def nodes_ready(api: ApiClient, names: Iterable[str]) -> bool:
    """Every one Ready and without the node controller's not-ready/unreachable taints."""
    listed = request(api, "GET", "/api/v1/nodes", query=[("labelSelector", f"{BENCH_LABEL}=true")])
    by_name = {n["metadata"]["name"]: n for n in listed.get("items") or []}
    for name in names:
        node = by_name.get(name)
        if node is None:
            return False
        conds = (node.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        taints = {t["key"] for t in (node.get("spec") or {}).get("taints") or []}
        if not ready or taints & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}:
            return False
    return True


def take_offline(api: ApiClient, nodes: Iterable[str]) -> None:
    """The site's kubelets go away: kwok no longer reports the Nodes Ready (`OFFLINE_LABEL`),
    and their Ready turns Unknown, written as the node lifecycle controller writes it when a
    kubelet stops posting (which it would do itself after its grace period). kwok still renews
    their Leases: the controller keeps Unknown (it never writes Ready True itself)."""
    now = now_rfc3339()
    for name in nodes:
        meta = {"metadata": {"labels": {OFFLINE_LABEL: "true"}}}
        request(api, "PATCH", f"/api/v1/nodes/{name}", body=meta, content_type=MERGE)
        unknown = {
            "type": "Ready",
            "status": "Unknown",
            "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.",
            "lastTransitionTime": now,
            "lastHeartbeatTime": now,
        }
        body = {"status": {"conditions": [unknown]}}
        request(api, "PATCH", f"/api/v1/nodes/{name}/status", body=body, content_type=STRATEGIC)


def bring_back(api: ApiClient, nodes: Iterable[str]) -> None:
    """The kubelets are back: kwok reports the Nodes Ready again."""
    for name in nodes:
        meta = {"metadata": {"labels": {OFFLINE_LABEL: None}}}
        request(api, "PATCH", f"/api/v1/nodes/{name}", body=meta, content_type=MERGE)


# ----------------------------------------------------------------------------- origin


def _socket_inode(client_port: int, server_port: int) -> int | None:
    """The inode of the client's end of a loopback TCP connection."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                local, remote = int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16)
                if local == client_port and remote == server_port:
                    return int(f[9])
    return None


def _pid_with_socket(inode: int, pids: Iterable[int]) -> int | None:
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
    return None


@dataclass
class OriginState:
    files: dict[str, Path]
    who: Callable[[int, int], str]  # (client port, server port) -> site
    bytes_by_site: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[float, str, str]] = field(default_factory=list)  # (t, site, path)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, site: str, n: int) -> None:
        with self.lock:
            self.bytes_by_site[site] = self.bytes_by_site.get(site, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.bytes_by_site)


class _OriginHandler(BaseHTTPRequestHandler):
    server: _OriginServer
    protocol_version = "HTTP/1.1"
    site = ""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.site = self.server.state.who(self.client_address[1], self.server.server_address[1])

    def do_GET(self) -> None:
        state = self.server.state
        site = self.headers.get("X-Bench-Site") or self.site
        path = state.files.get(self.path.split("?", 1)[0].lstrip("/"))
        with state.lock:
            state.requests.append((time.time(), site, self.path))
        if path is None:
            self.send_error(404)
            return
        size = path.stat().st_size
        start, end = _range(self.headers.get("Range", ""), size)
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if self.headers.get("Range") else 200)
        if self.headers.get("Range"):
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.flush()
        self._send(path, start, end - start + 1, site)

    def _send(self, path: Path, offset: int, count: int, site: str) -> None:
        with path.open("rb") as f:
            while count > 0:
                sent = os.sendfile(
                    self.connection.fileno(), f.fileno(), offset, min(count, 1 << 20)
                )
                if sent <= 0:
                    return
                self.server.state.count(site, sent)
                offset, count = offset + sent, count - sent


def _range(header: str, size: int) -> tuple[int, int]:
    if not header.startswith("bytes="):
        return 0, size - 1
    first, _, last = header.removeprefix("bytes=").partition("-")
    start = int(first or 0)
    return start, min(int(last), size - 1) if last else size - 1


class _OriginServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: OriginState) -> None:
        super().__init__(("127.0.0.1", 0), _OriginHandler)
        self.state = state


class CountingOrigin:
    """The model origin: `files` by URL path, bytes counted per site."""

    def __init__(self, files: dict[str, Path], pids: Callable[[], dict[int, str]]) -> None:
        self._pids = pids
        self.state = OriginState(files, self._who)
        self._server = _OriginServer(self.state)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _who(self, client_port: int, server_port: int) -> str:
        inode = _socket_inode(client_port, server_port)
        pids = self._pids()
        pid = None if inode is None else _pid_with_socket(inode, pids)
        return pids.get(pid, "unattributed") if pid is not None else "unattributed"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


# ----------------------------------------------------------------------------- node agents


class EmulatedAgent:
    """A site's agent, emulated: every 2 s, what its Nodes' stage requests and its pods name
    (spec.model, and a rollout's stableSpec.model), downloaded once from the origin (sha256
    checked, nothing kept), then its Node labelled as the real agent labels it."""

    def __init__(self, api: ApiClient, ns: str, site: str, warm: str) -> None:
        self.api, self.ns, self.site, self.warm = api, ns, site, warm
        self.node = node_names(site)[0]
        self.held: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"agent-{site}")

    def _run(self) -> None:
        while not self.stop.wait(2.0):
            with contextlib.suppress(ApiException, httpx.HTTPError, OSError, ValueError):
                for url, sha, size in self._wanted():
                    if sha not in self.held and self._download(url, sha, size):
                        self.held.add(sha)
                        body = {"metadata": {"labels": {cache_label(sha): "true"}}}
                        path = f"/api/v1/nodes/{self.node}"
                        request(self.api, "PATCH", path, body=body, content_type=MERGE)

    def _named(self) -> set[tuple[str, str]]:
        node = request(self.api, "GET", f"/api/v1/nodes/{self.node}")
        named = set(stage_requests(node["metadata"].get("annotations")))
        named.add((self.ns, self.warm))
        for name in node_names(self.site):
            query = [("fieldSelector", f"spec.nodeName={name}")]
            pods = request(self.api, "GET", f"/api/v1/namespaces/{self.ns}/pods", query=query)
            for pod in pods.get("items") or []:
                owner = (pod["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
                if owner:
                    named.add((pod["metadata"]["namespace"], owner))
        return named

    def _wanted(self) -> list[tuple[str, str, int]]:
        out = []
        for ns, name in self._named():
            path = f"/apis/ember.dev/v1alpha1/namespaces/{ns}/inferencedeployments/{name}"
            try:
                obj = request(self.api, "GET", path)
            except ApiException:
                continue
            for model in (obj["spec"].get("model"), stable_model(obj)):
                fetch = fetch_from_spec(model) if model else None
                out += [(f.url, f.sha256, f.size_bytes) for f in (fetch.files if fetch else [])]
        return out

    def _download(self, url: str, sha: str, size: int) -> bool:
        digest, got = hashlib.sha256(), 0
        headers = {"X-Bench-Site": self.site}
        with httpx.stream("GET", url, headers=headers, timeout=60) as response:
            for chunk in response.iter_bytes(1 << 20):
                digest.update(chunk)
                got += len(chunk)
        return got == size and digest.hexdigest() == sha


@dataclass
class Agents:
    """A node agent per site on its first Node, and on both Nodes of the sites in `both` (the
    real replicas' sites: whichever Node the replica lands on has its agent, and the two share
    over the site's LAN): real processes for `real` sites (SiteWorld), emulated for the rest.
    Each agent's own pod claims `warm`, an InferenceDeployment of no replicas whose model is the
    first version: every site holds it before the bench starts, as a fleet that runs it does."""

    kube: Kube
    namespace: str
    tmp: Path
    sites: list[str]
    real: set[str]
    both: set[str]
    world: SiteWorld | None = None
    emulated: dict[str, EmulatedAgent] = field(default_factory=dict)
    by_node: dict[str, str] = field(default_factory=dict)

    def start(self, warm: tuple[str, dict[str, Any]]) -> None:
        self.world = SiteWorld(self.kube, self.namespace, self.tmp, site="rollout")
        self.world.install()
        for site in sorted(self.real):
            nodes = node_names(site) if site in self.both else node_names(site)[:1]
            self.by_node.update(dict.fromkeys(nodes, site))
        self.world.nodes = list(self.by_node)
        self.world.map_sites(self.by_node)
        self.world.want(None)
        self._claim(*warm)
        server = str(self.kube.api.configuration.host)
        self.world.start(server, extra=["--lease_seconds=15", "--log_level=WARNING"])
        for site in self.sites:
            if site not in self.real:
                agent = EmulatedAgent(self.kube.api, self.namespace, site, warm[0])
                agent.thread.start()
                self.emulated[site] = agent

    def _claim(self, name: str, model: dict[str, Any]) -> None:
        """Each agent's pod names `name` the way the operator's pods do."""
        assert self.world is not None
        body = {"metadata": claim_metadata(name, model)}
        for pod in self.world.pods:
            path = f"/api/v1/namespaces/{self.namespace}/pods/{pod}"
            request(self.kube.api, "PATCH", path, body=body, content_type=STRATEGIC)

    def pids(self) -> dict[int, str]:
        agents = self.world.agents if self.world else []
        return {a.proc.pid: self.by_node[a.node] for a in agents if a.proc is not None}

    def demote(self, shares: int) -> bool:
        """The agents in one cgroup of `shares` CPU shares (a root-level process has 1024): on
        a fleet each site's agent runs on that site's machines, not on the real replicas'
        cores; here 50 sites share two. False where there is no writable cpu controller."""
        if not (CPU_CGROUP.is_dir() and os.access(CPU_CGROUP, os.W_OK)):
            return False
        group = CPU_CGROUP / f"{CGROUP_PREFIX}agents"
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(shares))
        for pid in self.pids():
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))
        return True

    def has_real(self, site: str) -> bool:
        return site in self.by_node.values()

    def cache_file(self, site: str, sha: str, size: int) -> Path | None:
        """The complete blob in one of the site's agents' caches, if there is one yet."""
        for agent in self.world.agents if self.world else []:
            if self.by_node.get(agent.node) == site and agent.cache.has(sha, size):
                return agent.cache.path(sha)
        return None

    def signal(self, site: str, sig: signal.Signals) -> None:
        """SIGSTOP / SIGCONT a site's real agent (it loses the API server with its site)."""
        for pid, where in self.pids().items():
            if where == site:
                os.kill(pid, sig)

    def rss_mib(self) -> float:
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        return total / 1024

    def cache_bytes(self) -> int:
        total = 0
        for agent in self.world.agents if self.world else []:
            blobs = agent.cache.blobs
            if blobs.is_dir():
                total += sum(p.stat().st_size for p in blobs.iterdir() if p.is_file())
        return total

    def close(self) -> None:
        for agent in self.emulated.values():
            agent.stop.set()
        if self.world is not None:
            self.world.stop_agents()
            self.world.nodes = []  # the bench deletes its own Nodes
            self.world.close()
        with contextlib.suppress(OSError):
            (CPU_CGROUP / f"{CGROUP_PREFIX}agents").rmdir()


# ----------------------------------------------------------------------------- watching


class Watcher:
    """List, then watch, one collection until stopped; every object goes to `on_event` (also
    the listed ones, as ADDED). Resumes from the last resourceVersion; relists after a 410."""

    def __init__(
        self,
        api: ApiClient,
        path: str,
        on_event: Callable[[str, dict[str, Any]], None],
        query: list[tuple[str, str]] | None = None,
    ) -> None:
        self.api, self.path, self.on_event, self.query = api, path, on_event, query or []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"watch {path}")

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                listed = request(self.api, "GET", self.path, query=self.query)
                for obj in listed.get("items") or []:
                    self.on_event("ADDED", obj)
                version: str | None = listed["metadata"]["resourceVersion"]
                while version is not None and not self.stop.is_set():
                    version = self._watch(version)
            except Exception as exc:  # a watcher outlives any one failure
                print(f"watch {self.path}: {exc!r}", file=sys.stderr)
                self.stop.wait(1.0)

    def _watch(self, version: str) -> str | None:
        params = [*self.query, ("watch", "1"), ("resourceVersion", version)]
        params.append(("timeoutSeconds", "60"))
        for event in _stream(self.api, self.path, params, 75):
            if event.get("type") == "ERROR":
                return None
            obj = event.get("object") or {}
            version = (obj.get("metadata") or {}).get("resourceVersion", version)
            if event.get("type") != "BOOKMARK":
                self.on_event(str(event["type"]), obj)
            if self.stop.is_set():
                break
        return version


def _stream(
    api: ApiClient, path: str, params: list[tuple[str, str]], timeout: float
) -> Iterator[dict[str, Any]]:
    serialized = api.param_serialize(
        method="GET",
        resource_path=path,
        query_params=params,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*serialized, _request_timeout=timeout)
    buffer = b""
    for chunk in response.response.stream(65536):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


# ----------------------------------------------------------------------------- versions


@dataclass
class Versions:
    """Which version a pod runs, from its pod template's config hash: the hashes seen when the
    first version was complete are "v1"; after that, any other is the change under test, of
    kind `new_kind` (good, bad-load or slow)."""

    v1_hashes: set[str] | None = None
    new_kind: str = "good"

    def freeze(self, hashes: Iterable[str]) -> None:
        self.v1_hashes = set(hashes)

    def of(self, pod: dict[str, Any]) -> str:
        h = ((pod.get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH, "")
        return "v1" if self.v1_hashes is None or h in self.v1_hashes else "new"

    def kind(self, version: str) -> str:
        return "good" if version == "v1" else self.new_kind


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def deleting(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


# ----------------------------------------------------------------------------- timeline


BROKEN, DOWN, OFFLINE = "broken", "down", "offline"


@dataclass
class PodSeen:
    site: str
    version: str
    ready: bool
    gone: bool


class Timeline:
    """Each site's state over time: `v1` or `new` (which version its Ready replicas serve),
    `broken` (a Ready replica of a slow version, or a replica of a version that does not load
    where the previous one was), `down` (nothing Ready), `offline` (its nodes are away); and
    when a site first ran the broken version at all (`ran_broken`: a pod of the version that
    does not load bound there, or a Ready replica of the slow one), even beside a Ready v1."""

    def __init__(self, sites: list[str], site_of_node: dict[str, str], versions: Versions) -> None:
        self.sites, self.site_of_node, self.versions = sites, site_of_node, versions
        self.pods: dict[str, PodSeen] = {}
        self.offline: set[str] = set()
        self.states: dict[str, list[tuple[float, str]]] = {}
        self.ran_broken: dict[str, float] = {}
        self.lock = threading.Lock()

    def mark(self) -> None:
        """Histories start afresh, from every site's state now."""
        with self.lock:
            self.states, self.ran_broken = {}, {}
            for site in self.sites:
                self._note(site)

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        site = self.site_of_node.get((pod.get("spec") or {}).get("nodeName") or "")
        if site is None:
            return
        name = pod["metadata"]["name"]
        seen = PodSeen(site, self.versions.of(pod), pod_ready(pod), kind == "DELETED")
        seen.gone = seen.gone or deleting(pod)
        with self.lock:
            self.pods[name] = seen
            self._note(site)

    def set_offline(self, site: str, away: bool) -> None:
        with self.lock:
            (self.offline.add if away else self.offline.discard)(site)
            self._note(site)

    def _state(self, site: str) -> str:
        if site in self.offline:
            return OFFLINE
        live = [p for p in self.pods.values() if p.site == site and not p.gone]
        ready = [p for p in live if p.ready]
        kinds = {p.version: self.versions.kind(p.version) for p in live}
        if any(kinds[p.version] == "slow" for p in ready):
            return BROKEN
        if not ready and any(kinds[p.version] == "bad-load" for p in live):
            return BROKEN
        if ready:
            return "new" if any(p.version == "new" for p in ready) else "v1"
        return DOWN

    def _note(self, site: str) -> None:
        state, history = self._state(site), self.states.setdefault(site, [])
        if not history or history[-1][1] != state:
            history.append((time.time(), state))
        if site not in self.ran_broken and self._runs_broken(site):
            self.ran_broken[site] = time.time()

    def _runs_broken(self, site: str) -> bool:
        for p in self.pods.values():
            if p.site != site or p.gone:
                continue
            kind = self.versions.kind(p.version)
            if kind == "bad-load" or (kind == "slow" and p.ready):
                return True
        return False

    def state(self, site: str) -> str:
        with self.lock:
            return self._state(site)

    def count(self, state: str) -> int:
        with self.lock:
            return sum(self._state(s) == state for s in self.sites)

    def snapshot(self) -> dict[str, list[tuple[float, str]]]:
        with self.lock:
            return {s: list(h) for s, h in self.states.items()}

    def ran(self) -> dict[str, float]:
        with self.lock:
            return dict(self.ran_broken)


# ----------------------------------------------------------------------------- the kubelet


@dataclass
class Replica:
    """A real runtime process behind one pod."""

    pod: str
    site: str
    ip: str
    port: int
    version: str
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    ended: bool = False
    failure: str | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    cpu_s: float = 0.0  # last seen (sampled while it runs)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_quota(limit: str | None) -> float | None:
    if not limit:
        return None
    return int(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)


def _log_tail(path: Path) -> str:
    data = path.read_bytes()[-LOG_TAIL_BYTES:] if path.exists() else b""
    lines = data.decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(lines)


def termination_message(term: Path, log: Path) -> str:
    """What the kubelet puts in lastState.terminated.message: the termination-log file, or
    (FallbackToLogsOnError, as the operator renders it) the log's last 2 kB / 80 lines."""
    text = term.read_text() if term.exists() else ""
    return text.strip() or _log_tail(log)


def failed_status(
    image: str, exit_code: int, message: str, now: str, ip: str = ""
) -> dict[str, Any]:
    """A runtime container that exited on start and is backing off, as the kubelet reports it."""
    runtime = {
        "name": "runtime",
        "image": image,
        "imageID": "",
        "ready": False,
        "started": False,
        "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}},
    }
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            condition("Initialized", True, now),
            condition("ContainersReady", False, now),
            condition("Ready", False, now),
        ],
        "containerStatuses": [runtime],
        "initContainerStatuses": [_prewarm_done(image, now)],
        "hostIP": "127.0.0.1",
        "startTime": now,
    }
    if ip:
        status.update({"podIP": ip, "podIPs": [{"ip": ip}]})
    return status


def _prewarm_done(image: str, now: str) -> dict[str, Any]:
    done = {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
    return {
        "name": "prewarm",
        "image": image,
        "imageID": "",
        "ready": True,
        "restartCount": 0,
        "state": {"terminated": done},
    }


def running_status(image: str, ip: str, ready: bool, now: str) -> dict[str, Any]:
    runtime = {
        "name": "runtime",
        "image": image,
        "imageID": "",
        "ready": ready,
        "started": True,
        "restartCount": 0,
        "state": {"running": {"startedAt": now}},
    }
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "startTime": now,
        "conditions": [
            condition("Initialized", True, now),
            condition("ContainersReady", ready, now),
            condition("Ready", ready, now),
        ],
        "initContainerStatuses": [_prewarm_done(image, now)],
        "containerStatuses": [runtime],
    }


def synthetic_health(kind: str, ratio: float) -> dict[str, Any]:
    """What a kwok replica's runtime would report: 30 requests, no error, TTFT p99 300 ms (x
    `ratio` for the slow version). Synthetic: no process serves behind a kwok pod."""
    ttft = round(SYNTHETIC_TTFT_MS * (ratio if kind == "slow" else 1.0))
    report = HealthReport(
        requests=30, errors=0, ttft_p99_ms=ttft, throttled=False, window_seconds=HEALTH_WINDOW_S
    )
    return health_condition(report, now_rfc3339())


@dataclass
class KubeletConfig:
    namespace: str
    real_sites: set[str]
    site_of_node: dict[str, str]
    workdir: Path
    slow_ratio: float = 3.0
    health_window_s: int = HEALTH_WINDOW_S
    load_timeout_s: float = 600.0
    ready_timeout_s: float = 180.0


class Kubelet:
    """The kubelet's part for the pods kwok does not run (see the module docstring)."""

    def __init__(
        self, kube: Kube, cfg: KubeletConfig, agents: Agents, versions: Versions, relay: str
    ) -> None:
        self.kube, self.cfg, self.agents, self.versions = kube, cfg, agents, versions
        self.relay = relay  # the real runtime's termination message for the broken version
        self.replicas: dict[str, Replica] = {}
        self.synthetic: set[str] = set()  # kwok pods written to (health or failure)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(6, thread_name_prefix="kubelet")
        self._ips = iter(f"127.0.{2 + i // 250}.{1 + i % 250}" for i in range(10_000))
        self.cgroups = CPU_CGROUP.is_dir() and os.access(CPU_CGROUP, os.W_OK)

    # -- dispatch -------------------------------------------------------------------------
    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        site = self.cfg.site_of_node.get(node or "")
        if site is None:
            return
        name = pod["metadata"]["name"]
        gone = kind == "DELETED" or deleting(pod)
        if site in self.cfg.real_sites:
            self._real(name, site, pod, gone)
        elif not gone:
            self._kwok(name, pod)

    def _real(self, name: str, site: str, pod: dict[str, Any], gone: bool) -> None:
        with self.lock:
            replica = self.replicas.get(name)
            if replica is None and not gone:
                replica = self._new_replica(name, site, pod)
                self.replicas[name] = replica
                run = threading.Thread(
                    target=self._guard, args=(self._run_replica, replica, pod), daemon=True
                )
                run.start()
        if gone and replica is not None and not replica.ended:
            replica.ended = True
            threading.Thread(target=self._stop, args=(replica,), daemon=True).start()

    def _kwok(self, name: str, pod: dict[str, Any]) -> None:
        kind = self.versions.kind(self.versions.of(pod))
        key = f"{name}/{kind}"
        with self.lock:
            if key in self.synthetic:
                return
            broken = kind == "bad-load"
            if not broken and not pod_ready(pod):
                return
            self.synthetic.add(key)
        image = pod["spec"]["containers"][0]["image"]
        if broken:
            status = failed_status(image, 3, self.relay, now_rfc3339())
        else:
            status = {"conditions": [synthetic_health(kind, self.cfg.slow_ratio)]}
        self.pool.submit(self._guard, patch_status, self.kube.api, self.cfg.namespace, name, status)

    @staticmethod
    def _guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # one pod's trouble must not stop the bench
            print(f"kubelet: {fn.__name__}: {exc!r}", file=sys.stderr)

    # -- real replicas --------------------------------------------------------------------
    def _new_replica(self, name: str, site: str, pod: dict[str, Any]) -> Replica:
        work = self.cfg.workdir / name
        work.mkdir(parents=True, exist_ok=True)
        version = self.versions.of(pod)
        return Replica(name, site, next(self._ips), 8080, version, work)

    def _run_replica(self, replica: Replica, pod: dict[str, Any]) -> None:
        config, model = self._config_and_model(replica, pod)
        if replica.ended:
            return
        image = pod["spec"]["containers"][0]["image"]
        ns = self.cfg.namespace
        patch_status(self.kube.api, ns, replica.pod, running_status(image, replica.ip, False, _n()))
        self._spawn(replica, pod, config, model)
        ready = self._wait_ready(replica)
        if replica.ended:  # the pod went while the replica started
            self._stop(replica)
        elif ready:
            replica.ready, replica.ready_at = True, time.time()
            status = running_status(image, replica.ip, True, _n())
            patch_status(self.kube.api, ns, replica.pod, status)
        elif replica.proc is not None and replica.proc.poll() is not None and not replica.ended:
            term, log = replica.workdir / "termination-log", replica.workdir / "runtime.log"
            replica.failure = termination_message(term, log)
            code = int(replica.proc.returncode)
            failed = failed_status(image, code, replica.failure, _n(), replica.ip)
            patch_status(self.kube.api, ns, replica.pod, failed)

    def _config_and_model(self, replica: Replica, pod: dict[str, Any]) -> tuple[Path, Path]:
        """The rendered config with the node-local paths this machine gives it (the kubelet's
        mounts), and the model as a view of the site agent's cached blob (prewarm's wait)."""
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        cm_name = volumes["config"]["configMap"]["name"]
        path = f"/api/v1/namespaces/{self.cfg.namespace}/configmaps/{cm_name}"
        cm = request(self.kube.api, "GET", path)
        config = yaml.safe_load(cm["data"]["config.yaml"])
        config["server"].update({"host": replica.ip, "port": replica.port})
        config["sensors"]["sysfsRoot"] = str(replica.workdir / "sys")
        config["terminationLog"] = str(replica.workdir / "termination-log")
        config["modelDir"] = str(replica.workdir / "model")
        config["prewarmDir"] = None
        (replica.workdir / "sys").mkdir(exist_ok=True)
        written = replica.workdir / "config.yaml"
        written.write_text(yaml.safe_dump(config))
        first = config["files"][0]
        return written, self._model_view(replica, first["sha256"], int(first["sizeBytes"]))

    def _model_view(self, replica: Replica, sha: str, size: int) -> Path:
        if not self.agents.has_real(replica.site):
            raise RuntimeError(f"site {replica.site} has no real agent for its real replica")

        def cached() -> Path | None:
            if replica.ended:
                raise RuntimeError(f"{replica.pod} ended before {sha[:12]} reached the site cache")
            return self.agents.cache_file(replica.site, sha, size)

        what = f"{replica.pod}: {sha[:12]} in the site cache"
        blob = wait_for(what, cached, self.cfg.load_timeout_s, 0.5)
        view = replica.workdir / "model" / "model.gguf"
        view.parent.mkdir(exist_ok=True)
        view.unlink(missing_ok=True)
        view.symlink_to(blob)
        return view

    def _spawn(self, replica: Replica, pod: dict[str, Any], config: Path, model: Path) -> None:
        env = {**os.environ, **self._identity(replica, pod)}
        argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(config)]
        argv += ["--model", str(model), "--log-level", "warning"]
        argv += [f"--health-window-seconds={self.cfg.health_window_s}"]
        limit = (pod["spec"]["containers"][0].get("resources") or {}).get("limits", {}).get("cpu")
        with (replica.workdir / "runtime.log").open("wb") as out:
            replica.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        # Moved before its interpreter has started any thread (imports take a second).
        self._cgroup(replica, replica.proc.pid, cpu_quota(limit))
        replica.started_at = time.time()

    def _identity(self, replica: Replica, pod: dict[str, Any]) -> dict[str, str]:
        """POD_NAME/POD_NAMESPACE (the downward API) and a token bound to the pod (its
        projected ServiceAccount token), as the operator's pod template gives the runtime."""
        body = {
            "spec": {
                "audiences": [],
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": replica.pod,
                    "uid": pod["metadata"]["uid"],
                },
            }
        }
        path = f"/api/v1/namespaces/{self.cfg.namespace}/serviceaccounts/{RUNTIME_SA}/token"
        token = request(self.kube.api, "POST", path, body=body)["status"]["token"]
        sa = replica.workdir / "sa"
        sa.mkdir(exist_ok=True)
        (sa / "token").write_text(token)
        shutil.copy(str(self.kube.api.configuration.ssl_ca_cert), sa / "ca.crt")
        host, port = api_server(self.kube)
        return {
            "POD_NAME": replica.pod,
            "POD_NAMESPACE": self.cfg.namespace,
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": str(port),
            "EMBER_SERVICEACCOUNT_DIR": str(sa),
        }

    def _cgroup(self, replica: Replica, pid: int, quota: float | None) -> None:
        """The pod's CPU limit as a CFS quota (what the kubelet sets), in a cgroup v1 of its
        own; nothing where there is no writable cpu controller (the results say which)."""
        if quota is None or not self.cgroups:
            return
        group = CPU_CGROUP / f"{CGROUP_PREFIX}{replica.pod}"
        group.mkdir(parents=True, exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(quota * 100_000)))
        (group / "cgroup.procs").write_text(str(pid))

    def _wait_ready(self, replica: Replica) -> bool:
        """Whether the runtime answered /readyz in time, before it exited or its pod went."""

        def state() -> str | None:
            if replica.ended:
                return "ended"
            if replica.proc is None or replica.proc.poll() is not None:
                return "exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{replica.url}/readyz", timeout=1).status_code == 200:
                    return "ready"
            return None

        return bool(poll(state, self.cfg.ready_timeout_s, 0.2) == "ready")

    def _stop(self, replica: Replica) -> None:
        """The pod is going: SIGTERM (the runtime drains), SIGKILL after the grace period."""
        proc = replica.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(35)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        with contextlib.suppress(OSError):
            (CPU_CGROUP / f"{CGROUP_PREFIX}{replica.pod}").rmdir()

    # -- what the load generator and the bench read ----------------------------------------
    def target(self, site: str) -> Replica | None:
        """The site's newest Ready replica whose pod is not going (a Service's endpoint)."""
        with self.lock:
            live = [r for r in self.replicas.values() if r.site == site and r.ready]
        live = [r for r in live if not r.ended]
        return live[-1] if live else None

    def sample_cpu(self) -> None:
        """Each running replica's CPU seconds, as last seen (the bench sums them)."""
        with self.lock:
            running = [r for r in self.replicas.values() if r.proc and r.proc.poll() is None]
        for replica in running:
            with contextlib.suppress(OSError, AttributeError):
                replica.cpu_s = cpu_seconds(replica.proc.pid)  # type: ignore[union-attr]

    def cpu_total(self) -> float:
        with self.lock:
            return sum(r.cpu_s for r in self.replicas.values())

    def stop_all(self) -> None:
        with self.lock:
            replicas = list(self.replicas.values())
        for replica in replicas:
            replica.ended = True
            self._stop(replica)
        self.pool.shutdown(wait=False, cancel_futures=True)


def _n() -> str:
    return now_rfc3339()


# ----------------------------------------------------------------------------- load


WORDS = [
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"),
    *("juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo"),
    *("sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"),
]


@dataclass(frozen=True)
class Sent:
    t: float
    site: str
    outcome: str  # ok, failed, unserved (no Ready replica at the site)
    version: str | None = None
    ttft_ms: float | None = None
    detail: str = ""


class Load:
    """A bounded request load on the real replicas: one request every `period` s per site,
    sent to a Ready replica of the site (as a Service would route), streamed; a prompt of
    `words` random words (no prefix shared between requests), 4 tokens generated."""

    def __init__(
        self,
        sites: list[str],
        target: Callable[[str], Replica | None],
        model: str,
        period: float = 2.0,
        words: int = 80,
    ) -> None:
        self.sites, self.target, self.model = sites, target, model
        self.period, self.words = period, words
        self.sent: list[Sent] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self.stop.clear()
        self.threads = [
            threading.Thread(target=self._run, args=(s,), daemon=True) for s in self.sites
        ]
        for t in self.threads:
            t.start()

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)

    def take(self) -> list[Sent]:
        with self.lock:
            out, self.sent = self.sent, []
        return out

    def _run(self, site: str) -> None:
        rng = random.Random(site)
        due = time.monotonic()
        while not self.stop.is_set():
            replica = self.target(site)
            sent = Sent(time.time(), site, "unserved")
            if replica is not None:
                sent = self._one(replica, " ".join(rng.choice(WORDS) for _ in range(self.words)))
            with self.lock:
                self.sent.append(sent)
            due += self.period
            self.stop.wait(max(0.0, due - time.monotonic()))

    def _one(self, replica: Replica, prompt: str) -> Sent:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "stream": True}
        start, ttft = time.time(), None
        try:
            with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=30) as r:
                if r.status_code != 200:
                    r.read()
                    return Sent(start, replica.site, "failed", replica.version, None, r.text[:200])
                for line in r.iter_lines():
                    if ttft is None and line.startswith("data:") and "[DONE]" not in line:
                        ttft = (time.time() - start) * 1000
        except httpx.HTTPError as exc:
            return Sent(start, replica.site, "failed", replica.version, None, repr(exc)[:200])
        return Sent(start, replica.site, "ok", replica.version, ttft)
