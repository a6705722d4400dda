"""Density on the local real cluster (issue 47): cold start from zero, and four models swapped
on a node that fits two. Ember is installed with its chart and site gateway as `make demo`
installs it (tests/e2e/flow.py); every request goes through the gateway's one URL.

Cold start (`coldstart`): a model at zero replicas (`spec.scaling`, minReplicas 0) whose file is
on the node. One streamed completion is sent; the gateway holds it, scales the model to one
replica and releases it when the replica is Ready. Phases, from a watch of the pod (each event
timed on arrival: the API server's own timestamps have whole seconds) and the client's clock:
request → pod created (the gateway's scale write, the operator's reconcile, the Deployment
controller) → scheduled → prewarm done (init container: node checks, the model verified and
copied into shared memory) → runtime started → Ready → first token. The reference is a warm
restart: the runtime container of a Ready replica killed on the node (SIGKILL through
containerd) and restarted by the kubelet in place, the model still in the pod's shared memory,
with the same held request through the gateway.

Swapping (`swap`): four InferenceDeployments of the test model, each replica asking a quarter
core and 1.5 GiB, on a node left with memory for two replicas (a pause pod takes the rest of its
allocatable memory, as the e2e's `node_full_for` does with CPU). Requests follow a Zipf
distribution (s = 1) over the four models (popularity assigned by a seeded shuffle, not by name)
from two clients. Three runs: the four always on without the filler (the baseline where they
fit); each `scaling` 0..1 with a long idleSeconds (only memory makes room) and the gateway's
`swapOrder=ollama`, Ollama's own rule (server/sched.go findRunnerToUnload: the first idle model
by keep-alive, then by name), the baseline policy; and Ember's rule, with the rarest model at
priority 10. Reported per model and run: TTFT p50/p99; per run: swaps (the gateway's counter),
OOM kills (pods' last states and the node's OOMKilling events), failed requests.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import httpx
import kubernetes
from ember_operator import quantity

from tests.cluster.cluster import Cluster
from tests.e2e.flow import SYSTEM_NS, Flow, Gateway, filler_pod
from tests.e2e.local import local_flow
from tests.support.waiting import wait_for

NAMESPACE = "density"
PROMPT = "The three most important things to check on a water pump are"
MAX_TOKENS = 16
FILLER = "density-filler"


@dataclass
class Phases:
    """Seconds from the request's send to each phase's end."""

    kind: str  # cold (from zero) or warm (container restart)
    created: float
    scheduled: float
    prewarmed: float
    started: float
    ready: float
    first_token: float
    total: float


def _ts(text: str | None) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else 0.0


def manifest(flow: Flow, name: str, model: str, **spec: Any) -> dict[str, Any]:
    doc = flow.model_manifest(name, NAMESPACE, replicas=0)
    doc["spec"]["model"]["name"] = model
    doc["spec"].update(spec)
    return doc


def first_token(
    base: str, model: str, timeout: float = 600, since: float | None = None
) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one held request, counted
    from `since` (wall clock; default: when it is sent)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    began = time.time() if since is None else since
    first = 0.0
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=timeout
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and not first:
                first = time.time() - began
    return first, time.time() - began


def pod_of(flow: Flow, name: str) -> dict[str, Any]:
    (pod,) = flow.pods(name, NAMESPACE)
    out = flow.run_kubectl("get", "pod", pod, "-n", NAMESPACE, "-o", "json")
    doc: dict[str, Any] = json.loads(out)
    return doc


@dataclass(frozen=True)
class Seen:
    """One pod's state as a watch event showed it, and when (this machine's clock)."""

    at: float
    uid: str
    scheduled: bool
    prewarmed: bool
    running: bool
    restarts: int
    ready: bool


def _seen(at: float, pod: Any) -> Seen:
    status = pod.status
    init = (status.init_container_statuses or [None])[0]
    runtime = next((c for c in status.container_statuses or [] if c.name == "runtime"), None)
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    return Seen(
        at,
        pod.metadata.uid,
        scheduled=bool(pod.spec.node_name),
        prewarmed=bool(init is not None and init.state.terminated is not None),
        running=bool(runtime is not None and runtime.state.running is not None),
        restarts=runtime.restart_count if runtime is not None else 0,
        ready=ready,
    )


class PodClock:
    """A watch over one InferenceDeployment's pods in a thread, timing each change as it
    arrives: the API server's own timestamps have whole seconds only."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.api = kubernetes.client.CoreV1Api(
            kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        )
        self.selector = f"ember.dev/instance={name}"
        self.seen: list[Seen] = []
        self.watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stream = self.watch.stream(  # type: ignore[no-untyped-call]
            self.api.list_namespaced_pod, NAMESPACE, label_selector=self.selector
        )
        for event in stream:
            self.seen.append(_seen(time.time(), event["object"]))

    def stop(self) -> None:
        self.watch.stop()  # type: ignore[no-untyped-call]

    def first(self, since: float, test: Callable[[Seen], bool]) -> float:
        """Seconds from `since` to the first state after it that passes `test` (nan: none)."""
        return next((x.at - since for x in self.seen if x.at >= since and test(x)), math.nan)


def cold_start(flow: Flow, cluster: Cluster, base: str, name: str, model: str) -> Phases:
    wait_for(f"{name} at zero", lambda: not flow.pods(name, NAMESPACE), 300, 1.0)
    clock = PodClock(cluster, name)
    time.sleep(1.0)  # the watch is listening
    sent = time.time()
    try:
        ttft, total = first_token(base, model)
    finally:
        clock.stop()
    return Phases(
        "cold",
        created=clock.first(sent, lambda x: True),
        scheduled=clock.first(sent, lambda x: x.scheduled),
        prewarmed=clock.first(sent, lambda x: x.prewarmed),
        started=clock.first(sent, lambda x: x.running),
        ready=clock.first(sent, lambda x: x.ready),
        first_token=ttft,
        total=total,
    )


def warm_restart(flow: Flow, cluster: Cluster, base: str, name: str, model: str) -> Phases:
    """The runtime container killed on the node (SIGKILL through containerd) and restarted by
    the kubelet in place: the pod, its prewarmed shared memory and its node stay."""
    first_token(base, model)  # a replica is up and Ready
    pod = pod_of(flow, name)
    (status,) = pod["status"]["containerStatuses"]
    clock = PodClock(cluster, name)
    time.sleep(1.0)
    sent = time.time()
    try:
        cluster.node.ctr("task", "kill", "-s", "SIGKILL", status["containerID"].split("//", 1)[1])
        wait_for("the replica out", lambda: _not_ready(flow, name), 60, 0.05)
        ttft, total = first_token(base, model, since=sent)  # from the kill
    finally:
        clock.stop()
    again = clock.first(sent, lambda x: x.restarts > status["restartCount"] and x.running)
    return Phases(
        "warm",
        created=math.nan,
        scheduled=math.nan,
        prewarmed=math.nan,
        started=again,
        ready=clock.first(sent + again, lambda x: x.ready) + again,
        first_token=ttft,
        total=total,
    )


def _not_ready(flow: Flow, name: str) -> bool:
    pod = pod_of(flow, name)
    return not any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"]
    )


# ----------------------------------------------------------------------------- swapping


def free_memory(flow: Flow) -> int:
    node = flow.target.node_name()
    obj = json.loads(flow.run_kubectl("get", "node", node, "-o", "json"))
    free = int(quantity.parse(obj["status"]["allocatable"]["memory"]))
    selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
    pods = flow.run_kubectl("get", "pods", "-A", "--field-selector", selector, "-o", "json")
    for pod in json.loads(pods)["items"]:
        for c in pod["spec"]["containers"]:
            free -= int(
                quantity.parse(c.get("resources", {}).get("requests", {}).get("memory", "0"))
            )
    return free


@contextlib.contextmanager
def room_for(flow: Flow, replicas: int, per_replica: int) -> Iterator[None]:
    """A pause pod takes the node's free memory but `replicas` × `per_replica` and a half."""
    spare = free_memory(flow) - int((replicas + 0.5) * per_replica)
    requests = {"memory": str(max(spare, 0))}
    pod = filler_pod(FILLER, NAMESPACE, flow.target.node_name(), requests)
    flow.apply(pod)
    try:
        yield
    finally:
        flow.run_kubectl("delete", "pod", FILLER, "-n", NAMESPACE, "--ignore-not-found")


def zipf_sequence(models: list[str], count: int, seed: int) -> list[str]:
    weights = [1 / (k + 1) for k in range(len(models))]
    return random.Random(seed).choices(models, weights, k=count)


@dataclass
class Sent:
    model: str
    ok: bool
    ttft: float
    error: str = ""


def drive(base: str, sequence: list[str], clients: int) -> list[Sent]:
    """`clients` threads taking the sequence's requests in order, one at a time each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(model: str) -> Sent:
        try:
            ttft, _ = first_token(base, model)
            return Sent(model, True, ttft)
        except httpx.HTTPError as exc:
            return Sent(model, False, 0.0, str(exc)[:200])

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, sequence))


def oom_kills(flow: Flow) -> int:
    events = flow.run_kubectl(
        "get", "events", "-A", "--field-selector", "reason=OOMKilling", "-o", "json"
    )
    pods = json.loads(flow.run_kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
    reasons = [
        c.get("lastState", {}).get("terminated", {}).get("reason")
        for p in pods
        for c in p["status"].get("containerStatuses", [])
    ]
    return len(json.loads(events)["items"]) + reasons.count("OOMKilled")


def gateway_counter(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def per_model(sent: list[Sent]) -> dict[str, dict[str, float]]:
    out = {}
    for model in sorted({s.model for s in sent}):
        ttfts = sorted(s.ttft for s in sent if s.model == model and s.ok)
        out[model] = {
            "requests": float(sum(s.model == model for s in sent)),
            "failed": float(sum(s.model == model and not s.ok for s in sent)),
            "ttftP50": statistics.median(ttfts) if ttfts else float("nan"),
            "ttftP99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
            if ttfts
            else float("nan"),
        }
    return out


# A quarter core each, so four fit the 2-CPU node by CPU and memory is what binds; the memory
# is the same for every model and above what sizing asks for this engine setting.
SWAP_MEMORY = "1536Mi"
SWAP_RESOURCES = {
    "requests": {"cpu": "250m", "memory": SWAP_MEMORY},
    "limits": {"cpu": "1", "memory": SWAP_MEMORY},
}


MODELS = ("density-a", "density-b", "density-c", "density-d")
# Zipf ranks by a seeded shuffle, so popularity has nothing to do with name order (which
# Ollama's rule uses); the rarest model is the one a person waits on (a kiosk's), the one a
# priority is for.
POPULARITY = random.Random(47).sample(MODELS, len(MODELS))
SHIELDED = POPULARITY[-1]
RUNS = {
    # name: (scaled, gateway swapOrder, the rarest model's priority)
    "alwaysOn": (False, "priority-lru", 0),
    "ollamaOrder": (True, "ollama", 0),
    "ember": (True, "priority-lru", 10),
}


def swap_run(flow: Flow, base: str, requests: int, run: str) -> dict[str, Any]:
    scaled, _, priority = RUNS[run]
    for model in MODELS:
        spec: dict[str, Any] = {
            "engine": {"threads": 1, "maxBatchSize": 4, "minBatchSize": 1},
            "resources": SWAP_RESOURCES,
            "replicas": 0 if scaled else 1,
        }
        if scaled:
            spec["scaling"] = {
                "minReplicas": 0,
                "maxReplicas": 1,
                "idleSeconds": 3600,  # only memory makes room
                "priority": priority if model == SHIELDED else 0,
            }
        flow.apply(manifest(flow, model.removeprefix("density-"), model, **spec))
    if not scaled:
        for model in MODELS:
            flow.wait_ready(model.removeprefix("density-"), NAMESPACE)
    sequence = zipf_sequence(POPULARITY, requests, seed=47)
    swaps_before = gateway_counter(base, "ember_gateway_swaps_total")
    began = time.time()
    sent = drive(base, sequence, clients=2)
    return {
        "scaled": scaled,
        "swapOrder": RUNS[run][1],
        "priorities": {SHIELDED: priority},
        "wall": time.time() - began,
        "perModel": per_model(sent),
        "failed": sum(not s.ok for s in sent),
        "errors": sorted({s.error for s in sent if s.error})[:5],
        "swaps": gateway_counter(base, "ember_gateway_swaps_total") - swaps_before,
        "oomKills": oom_kills(flow),
        "sequence": sequence,
    }


def cleanup(flow: Flow) -> None:
    flow.run_kubectl("delete", "infd", "--all", "-n", NAMESPACE, "--wait", timeout=300)


@contextlib.contextmanager
def served(flow: Flow, gateway: Gateway, *values: str) -> Iterator[str]:
    """The chart with its gateway (these values), and the gateway's URL through a port-forward
    (opened after the install: an upgrade replaces the gateway's pod)."""
    flow.install(values, gateway)
    with flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
        yield f"http://127.0.0.1:{port}"


def coldstart(flow: Flow, cluster: Cluster, gateway: Gateway, repeats: int) -> dict[str, Any]:
    with served(flow, gateway) as base:
        scaling = {"minReplicas": 0, "maxReplicas": 1, "idleSeconds": 5}
        flow.apply(manifest(flow, "lazy", "density-lazy", scaling=scaling))
        rows = []
        for _ in range(repeats):
            rows.append(asdict(cold_start(flow, cluster, base, "lazy", "density-lazy")))
            rows.append(asdict(warm_restart(flow, cluster, base, "lazy", "density-lazy")))
    return {"phases": rows}


def swapping(flow: Flow, gateway: Gateway, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {"popularity": POPULARITY, "shielded": SHIELDED}
    per_replica = int(quantity.parse(SWAP_MEMORY))
    for run, (scaled, order, _) in RUNS.items():
        with served(flow, gateway, f"gateway.swapOrder={order}") as base:
            room = room_for(flow, 2, per_replica) if scaled else contextlib.nullcontext()
            with room:
                out[run] = swap_run(flow, base, requests, run)
            cleanup(flow)
    out["replicaMemoryBytes"] = per_replica
    return out


def main(section: str, repeats: int, requests: int) -> dict[str, Any]:
    cluster = Cluster()
    cluster.up()
    flow = local_flow(cluster)
    flow.run_kubectl("create", "namespace", NAMESPACE, check=False)
    gateway = Gateway(NAMESPACE)
    try:
        if section == "coldstart":
            return coldstart(flow, cluster, gateway, repeats)
        return swapping(flow, gateway, requests)
    finally:
        cleanup(flow)
        subprocess.run(["sync"], check=False)


# ----------------------------------------------------------------------------- report

PHASES = ("created", "scheduled", "prewarmed", "started", "ready", "first_token")
COLD_GOAL_S, WARM_RATIO_GOAL = 2.0, 1.2


def _median(rows: list[dict[str, Any]], key: str) -> float:
    """The median of the rows that have the phase (nan: none has; see `_range`)."""
    values = [r[key] for r in rows if not math.isnan(r[key])]
    return float(statistics.median(values)) if values else math.nan


def _range(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if not math.isnan(r[key])]
    if not values:
        return "- (the pod stays)"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report_coldstart(section: dict[str, Any]) -> list[str]:
    cold = [r for r in section["phases"] if r["kind"] == "cold"]
    warm = [r for r in section["phases"] if r["kind"] == "warm"]
    out = [
        "## Cold start from zero (Gemma 3 270M, its file on the node)",
        "",
        f"`{section['command']}` at {section['commit']}; {len(cold)} cold starts and "
        f"{len(warm)} warm restarts. Seconds from the request's send (warm: from the kill) to "
        "each phase's end, median (min-max), pod phases timed as a watch delivered them.",
        "",
        "| phase | cold start (held request, scale from zero) | warm restart (container) |",
        "|---|---|---|",
    ]
    out += [f"| {p} | {_range(cold, p)} | {_range(warm, p)} |" for p in PHASES]
    late = sum(math.isnan(r["ready"]) for r in cold)
    if late:
        out += [
            "",
            f"In {late} of {len(cold)} cold starts the first token came before the kubelet's "
            "Ready (the watch stops at the first token): the gateway routes a woken replica on "
            "its own probe once the runtime answers.",
        ]
    first, ref = _median(cold, "first_token"), _median(warm, "first_token")
    ratio = first / ref if ref else float("nan")
    met = "met" if first <= COLD_GOAL_S else "**missed**"
    met_ratio = "met" if ratio <= WARM_RATIO_GOAL else "**missed**"
    out += [
        "",
        f"- First token from zero ≤ {COLD_GOAL_S:.0f} s: {met}, {first:.2f} s "
        f"({first / COLD_GOAL_S:.2f}× the goal).",
        f"- ≤ {WARM_RATIO_GOAL}× a warm restart: {met_ratio}, {ratio:.2f}× "
        f"({first:.2f} s against {ref:.2f} s).",
        "",
    ]
    return out


RUN_TITLES = {
    "alwaysOn": "always on (room for all four)",
    "ollamaOrder": "Ollama's rule (room for two)",
    "ember": "Ember: priority, then LRU (room for two)",
}


def _p(row: dict[str, float], key: str) -> str:
    return f"{row[key]:.2f}" if row else "-"


def report_swap(section: dict[str, Any]) -> list[str]:
    runs = [r for r in RUN_TITLES if r in section]
    first = section[runs[0]]
    shielded = section["shielded"]
    out = [
        "## Four models on a node that fits two",
        "",
        f"`{section['command']}` at {section['commit']}; {len(first['sequence'])} requests, Zipf "
        f"(s = 1) over four models by popularity {', '.join(section['popularity'])}, two "
        "clients, 16 tokens each; each replica 1.5 GiB and a quarter core, a filler pod leaving "
        f"the node room for two. Runs: {'; '.join(RUN_TITLES[r] for r in runs)}. In the Ember "
        f"run the rarest model, {shielded}, has priority 10 (a kiosk's model), the others 0; "
        "Ollama's rule (server/sched.go findRunnerToUnload: the first idle model by keep-alive, "
        "then by name) has no priorities.",
        "",
        "TTFT p50 / p99 in seconds, per model and run:",
        "",
        "| model | requests | " + " | ".join(RUN_TITLES[r] for r in runs) + " |",
        "|---|---|" + "---|" * len(runs),
    ]
    for model in section["popularity"]:
        cells = [section[r]["perModel"].get(model, {}) for r in runs]
        count = first["perModel"].get(model, {}).get("requests", 0)
        out.append(
            f"| {model} | {count:.0f} | "
            + " | ".join(f"{_p(c, 'ttftP50')} / {_p(c, 'ttftP99')}" for c in cells)
            + " |"
        )
    out.append("")
    for r in runs:
        run = section[r]
        out.append(
            f"- {RUN_TITLES[r]}: {run['swaps']:.0f} swaps, {run['oomKills']} OOM kills, "
            f"{run['failed']} failed requests, {run['wall']:.0f} s wall."
        )
    out.append("")
    return out


def plot_coldstart(section: dict[str, Any], ax: Any) -> None:
    for offset, kind in enumerate(("cold", "warm")):
        rows = [r for r in section["phases"] if r["kind"] == kind]
        bottom = 0.0
        for i, phase in enumerate(PHASES):
            end = _median(rows, phase)
            if math.isnan(end) or end < bottom:
                continue  # the pod stays (warm), or Ready came after the first token
            label = phase if offset == 0 else None
            ax.bar(offset, end - bottom, bottom=bottom, label=label, color=f"C{i}")
            bottom = end
    ax.set_xticks([0, 1], ["from zero", "warm restart"])
    ax.set_ylabel("seconds from the request")
    ax.set_title("cold start phases")
    ax.legend(fontsize=7)


def plot_swap(section: dict[str, Any], ax: Any) -> None:
    models = section["popularity"]
    runs = [r for r in RUN_TITLES if r in section]
    width = 0.8 / len(runs)
    for offset, run in enumerate(runs):
        values = [section[run]["perModel"].get(m, {}).get("ttftP99", 0.0) for m in models]
        xs = [i + offset * width for i in range(len(models))]
        ax.bar(xs, values, width=width, label=run)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=7)
    ax.set_ylabel("TTFT p99, s")
    ax.set_title("4 models, room for 2 (most popular first)")
    ax.legend(fontsize=7)
