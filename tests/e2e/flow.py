"""The whole chain on a real cluster, as steps shared by `make demo`, `make e2e`, `make e2e-kind`.

    images → load into the node → node labelled as a site, fake NPU device nodes and a fake
    thermal zone → helm install (operator + device plugin DaemonSet + node agent, optionally
    and the site gateway) → NPU capacity advertised → model on the node → InferenceDeployment
    → prewarm verifies + loads → runtime Ready (with its own ACL context) → streamed chat
    completion through the Service, and through the gateway's one URL → heat the fake sensor
    → batch lowered in `kubectl get infd` → cool → restored → helm uninstall leaves nothing

Each step prints what it does and how long it took, so a first run (which builds images) never
looks hung. The cluster-specific parts (how images get onto the node, where the API server is)
are behind `Target`, so kind (tests/e2e/kind.py) reuses every other step.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import httpx
from ember_operator import quantity

from tests.cluster.images import PAUSE_IMAGE
from tests.cluster.procs import port_forward
from tests.support.model import MODEL_SHA256, default_model_path
from tests.support.waiting import poll, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ember"
RELEASE = "ember"
SYSTEM_NS = "ember-system"
MODEL_DIR = Path("/var/lib/ember/models/gemma-3-270m")
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
SITE = "edge-lab"
# Fake Ascend nodes: character devices with /dev/null's numbers, so the container runtime can
# hand them to a container like the real ones. Two NPUs × the chart's 4 contexts = 8 units.
FAKE_NPUS = ("davinci0", "davinci1")
NPU_CONTROL = ("davinci_manager", "devmm_svm", "hisi_hdc")
NPU_UNITS = 8
# A fake sysfs thermal tree on the node, mounted into runtime pods (operator.sensorsSysfsRoot).
FAKE_SYS = Path("/var/lib/ember/e2e/sys")
FAKE_ZONE = FAKE_SYS / "class" / "thermal" / "thermal_zone0"
NODE_LABELS = {"ember.dev/site": SITE, "ember.dev/npu": "true"}
HOT_CELSIUS, COOL_CELSIUS = 87.0, 40.0
# A Degraded reason that stands this long fails a wait at once (with the reason). Long enough
# for a replace-rollout on a full node (old pod's drain, new pod's start), short against the
# 600 s a wait would otherwise burn.
DEGRADED_GRACE_SECONDS = 90.0
# What a call the chart's RBAC refused leaves in the operator's log: the client's "(403)" and
# "Forbidden", Kopf's APIForbiddenError, and Kopf's warnings when it falls back for want of a
# list/watch permission ("Not enough permissions to ..."). Not the milliseconds of a log
# timestamp ("18:36:53,403"), which failed a CI run on a clean log.
REFUSED = re.compile(r"forbidden|(?<![,.:\d])\b403\b|not enough permissions", re.IGNORECASE)
# A restarted kube-apiserver answers before its RBAC authorizer's informers have synced: for a
# moment every call is refused, and the operator's reconnecting watches log 403s that their
# retry then gets through (CI saw 8 such lines within 5 ms of the e2e's API server restart).
# Refusals that close to an outage are not the chart's RBAC; a missing grant keeps failing.
OUTAGE_GRACE_SECONDS = 30.0
# Kopf's "[2026-12-04 18:36:53,403]"; the gateway's logging "2026-12-04 18:36:53,403 WARNING".
_LOG_TIME = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\b")


def refusals(log: str, outages: list[tuple[float, float]]) -> list[str]:
    """The lines of an operator log that say a call was refused, except those logged during an
    API server outage (start, end as epoch seconds) or within OUTAGE_GRACE_SECONDS after it."""
    found = []
    for line in log.splitlines():
        if not REFUSED.search(line):
            continue
        match = _LOG_TIME.match(line)
        if match is not None:
            stamp = dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
            at = stamp.timestamp() + int(match[2]) / 1000
            if any(a <= at <= b + OUTAGE_GRACE_SECONDS for a, b in outages):
                continue
        found.append(line)
    return found


def step(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timed(msg: str) -> Iterator[None]:
    step(msg)
    start = time.monotonic()
    yield
    print(f"    done in {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Gateway:
    """The release's site gateway (docs/gateway.md): one OpenAI URL for every model of a site."""

    namespace: str  # the InferenceDeployments it serves
    site: str = ""  # only replicas on this site's nodes, and it runs there (empty: any node)

    @property
    def service(self) -> str:
        """Its Service (and Deployment): the chart's `<release>-gateway[-<site>]`."""
        return f"{RELEASE}-gateway-{self.site}" if self.site else f"{RELEASE}-gateway"

    def values(self) -> tuple[str, ...]:
        # One replica asking a twentieth of a core: the 2-CPU node holds the model's replicas
        # (a whole core and a quarter), and relaying a few requests costs little.
        site = (f"gateway.sites[0].name={self.site}",) if self.site else ()
        return (
            "gateway.enabled=true",
            f"gateway.namespace={self.namespace}",
            *site,
            "gateway.replicas=1",
            "gateway.resources.requests.cpu=50m",
        )


class Target(Protocol):
    """What differs between the project's local cluster and kind."""

    kubeconfig: Path

    def load_images(self) -> dict[str, str]:
        """Build Ember's images and make them available to the node; returns helm --set values."""

    def place_model(self, src: Path, dest_dir: Path) -> None:
        """Put the model file into `dest_dir` on the node (a hostPath source)."""

    def helm_values(self) -> list[str]:
        """Extra `--set` values for this cluster (image registry, API server address…)."""

    def node_name(self) -> str:
        """The Kubernetes name of the node that serves the model."""

    def node_run(self, argv: list[str]) -> int:
        """Run a command (argv, no shell) on that node as root; its exit status."""


@dataclass
class Flow:
    target: Target
    helm: str
    kubectl: str
    created_devices: list[str] = field(default_factory=list)  # fake /dev nodes we made
    api_outages: list[tuple[float, float]] = field(default_factory=list)  # epoch (down, back)

    def run_kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        cmd = [self.kubectl, f"--kubeconfig={self.target.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def run_helm(self, *args: str) -> str:
        cmd = [self.helm, f"--kubeconfig={self.target.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])}: {proc.stderr.strip()}")
        return proc.stdout

    # -- install ---------------------------------------------------------------------------
    def install(self, extra_values: tuple[str, ...] = (), gateway: Gateway | None = None) -> None:
        """Install (or upgrade) the chart; with `gateway`, the site gateway too. The gateway's
        namespace must exist first: its Role lives there."""
        with timed("building Ember's images and loading them into the node"):
            sets = self.target.load_images()
        with timed(f"helm install {RELEASE} charts/ember (namespace {SYSTEM_NS})"):
            values = [
                *self.target.helm_values(),
                *extra_values,
                *(gateway.values() if gateway else ()),
                *(f"{k}={v}" for k, v in sets.items()),
            ]
            args = [
                "upgrade",
                "--install",
                RELEASE,
                str(CHART),
                "--namespace",
                SYSTEM_NS,
                "--create-namespace",
                "--wait",
                "--timeout",
                "180s",
            ]
            for value in values:
                args += ["--set", value]
            self.run_helm(*args)
        with timed("rolling Ember's pods onto the freshly loaded images"):
            # Same tag, new image: nothing in the pod templates changed, so restart explicitly.
            workloads = [
                f"deploy/{RELEASE}-operator",
                f"ds/{RELEASE}-deviceplugin",
                f"ds/{RELEASE}-nodeagent",
            ]
            if gateway is not None:
                workloads.append(f"deploy/{gateway.service}")
            for workload in workloads:
                self.run_kubectl("-n", SYSTEM_NS, "rollout", "restart", workload)
                self.run_kubectl(
                    "-n", SYSTEM_NS, "rollout", "status", workload, "--timeout=180s", timeout=200
                )

    def uninstall(self) -> None:
        with timed(f"helm uninstall {RELEASE}"):
            self.run_helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait")

    def leftovers(self, served: Sequence[str] = (), timeout: float = 60) -> str:
        """What of the release is still there after `uninstall` (namespaced objects in its
        namespace and the `served` ones, where the gateway's Role lives, then cluster-scoped
        ones); pods finish terminating (their SIGTERM handling) after `helm uninstall --wait`
        returns, so this waits up to `timeout` for none."""
        selector = f"app.kubernetes.io/instance={RELEASE}"

        def found() -> str:
            kinds = "all,serviceaccounts,configmaps,roles,rolebindings"
            names = "".join(
                self.run_kubectl("get", kinds, "-n", ns, "-l", selector, "-o", "name")
                for ns in dict.fromkeys((SYSTEM_NS, *served))
            )
            names += self.run_kubectl(
                "get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name"
            )
            return names.strip()

        left: str = poll(found, timeout, 1, until=lambda names: not names)
        return left

    def refused_calls(self, component: str = "operator") -> list[str]:
        """Lines of a component's whole log (it runs on the chart's ServiceAccount for it) that
        say the API server refused a call."""
        log = self.run_kubectl(
            "logs", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/component={component}", "--tail=-1"
        )
        return refusals(log, self.api_outages)

    # -- the node: a site with (fake) NPUs and a (fake) thermal sensor ------------------------
    def prepare_node(self) -> None:
        node = self.target.node_name()
        with timed(f"node {node}: site {SITE}, fake NPUs {', '.join(FAKE_NPUS)}, fake sensor"):
            for name in (*FAKE_NPUS, *NPU_CONTROL):
                path = f"/dev/{name}"
                # Never replace (nor later remove) a node that was there: it may be a real NPU.
                # Positional arguments, never interpolated into the script.
                script = '[ -e "$1" ] && exit 3; mknod -m 0666 "$1" c 1 3'
                code = self.target.node_run(["sh", "-c", script, "sh", path])
                if code not in (0, 3):
                    raise RuntimeError(f"mknod {path} on the node failed (exit {code})")
                if code == 0:
                    self.created_devices.append(path)
            self._node(["mkdir", "-p", str(FAKE_ZONE)])
            self._write_node_file(FAKE_ZONE / "type", "soc-npu")
            self.set_temperature(COOL_CELSIUS)
            labels = [f"{k}={v}" for k, v in NODE_LABELS.items()]
            self.run_kubectl("label", "node", node, *labels, "--overwrite")

    @staticmethod
    def fake_node_values() -> tuple[str, ...]:
        """Helm values that point Ember at what `prepare_node` made (install after it)."""
        return (f"operator.sensorsSysfsRoot={FAKE_SYS}",)

    def restore_node(self) -> None:
        node = self.target.node_name()
        with timed(f"node {node}: removing the fake NPUs, sensor and labels"):
            self.run_kubectl("label", "node", node, *(f"{k}-" for k in NODE_LABELS), check=False)
            if self.created_devices:
                self._node(["rm", "-f", *self.created_devices])
                self.created_devices.clear()
            self._node(["rm", "-rf", str(FAKE_SYS)])

    def set_temperature(self, celsius: float) -> None:
        self._write_node_file(FAKE_ZONE / "temp", str(round(celsius * 1000)))

    def _write_node_file(self, path: Path, text: str) -> None:
        # Write then rename, as a sysfs read never sees half a value.
        script = 'printf "%s\\n" "$1" > "$2.tmp" && mv "$2.tmp" "$2"'
        self._node(["sh", "-c", script, "sh", text, str(path)])

    def _node(self, argv: list[str]) -> None:
        code = self.target.node_run(argv)
        if code != 0:
            raise RuntimeError(f"{argv[0]} on the node failed (exit {code}): {argv}")

    def wait_npu_capacity(self, units: int = NPU_UNITS, timeout: float = 120) -> None:
        node = self.target.node_name()
        with timed(f"waiting for the device plugin to advertise {units} ember.dev/npu on {node}"):

            def advertised() -> bool:
                obj = json.loads(self.run_kubectl("get", "node", node, "-o", "json"))
                return str(obj["status"].get("allocatable", {}).get("ember.dev/npu")) == str(units)

            wait_for("ember.dev/npu capacity", advertised, timeout, 0.1, tolerate=(Exception,))

    # -- the model -----------------------------------------------------------------------
    def model_manifest(
        self, name: str, namespace: str, replicas: int = 1, npu: bool = False
    ) -> dict[str, Any]:
        src = default_model_path()
        with timed(f"placing the model on the node under {MODEL_DIR}"):
            self.target.place_model(src, MODEL_DIR)
        return {
            "apiVersion": "ember.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "model": {
                    "name": "gemma-3-270m",
                    "format": "gguf",
                    "source": {"hostPath": {"path": str(MODEL_DIR)}},
                    "files": [
                        {
                            "path": MODEL_FILE,
                            "sha256": MODEL_SHA256,
                            "sizeBytes": src.stat().st_size,
                        }
                    ],
                },
                "engine": {
                    "kind": "llamacpp",
                    "contextLength": 1024,
                    "maxBatchSize": 8,
                    "minBatchSize": 2,
                },
                # llama.cpp computes on the CPU either way; with `npu` the replica also holds one
                # NPU context from the device plugin, on the site's NPU node.
                "accelerator": {"kind": "npu", "count": 1} if npu else {"kind": "cpu"},
                "placement": {"sites": [SITE]} if npu else {},
                "prewarm": {"enabled": True, "sharedMemoryLimit": "512Mi"},
            },
        }

    def embedding_manifest(self, name: str, namespace: str) -> dict[str, Any]:
        """The same GGUF served for embeddings on the CPU: Gemma's GGUF names no pooling (a
        generative model), so the spec sets mean."""
        manifest = self.model_manifest(name, namespace)
        manifest["spec"]["model"].update(task="embed", pooling="mean")
        manifest["spec"]["engine"].update(contextLength=512, maxBatchSize=4, minBatchSize=2)
        # A quarter of a core: the 2-CPU node already holds the generating replica's whole CPU
        # (CI: "Insufficient cpu" with the default of 1), and two short inputs need little.
        manifest["spec"]["resources"] = {"requests": {"cpu": "250m"}}
        return manifest

    def apply(self, manifest: dict[str, Any]) -> None:
        cmd = [self.kubectl, f"--kubeconfig={self.target.kubeconfig}", "apply", "-f", "-"]
        proc = subprocess.run(
            cmd, input=json.dumps(manifest), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl apply: {proc.stderr.strip()}")

    def wait_ready(
        self,
        name: str,
        namespace: str,
        timeout: float = 600,
        *,
        until: Callable[[dict[str, Any]], bool] | None = None,
        what: str = "Ready",
    ) -> dict[str, Any]:
        """Wait for the object's Ready condition (and `until`, if given); return the object.

        Fails fast once a `Degraded` reason has stood for DEGRADED_GRACE_SECONDS: a replica
        that cannot be scheduled or prewarmed will not become Ready by waiting, and the
        object's own reason says why. A reason that clears (a rollout freeing room, a slow
        first pull) restarts the clock.
        """
        echo, degraded = Echo(), DegradedClock()

        def done() -> dict[str, Any] | None:
            row = self.run_kubectl(
                "get", "infd", name, "-n", namespace, "--no-headers", check=False
            )
            echo(row.strip())
            obj: dict[str, Any] = json.loads(
                self.run_kubectl("get", "infd", name, "-n", namespace, "-o", "json")
            )
            if _condition(obj, "Ready") == "True" and (until is None or until(obj)):
                return obj
            stuck = degraded.update(obj)
            if stuck is not None:
                raise DegradedError(f"{name} is {stuck}\n{self.dump(namespace)}")
            return None

        with timed(f"waiting for InferenceDeployment {namespace}/{name} to be {what}"):
            ready: dict[str, Any] = wait_for(
                f"{name} to be {what}", done, timeout, 2, on_fail=lambda: self.dump(namespace)
            )
            return ready

    def wait_rolled(self, name: str, namespace: str, old_pods: list[str]) -> list[str]:
        """After an edit: wait until the new generation is observed, Ready, and served only by
        new pods (none of `old_pods` left); returns the live pods."""

        def rolled(obj: dict[str, Any]) -> bool:
            observed = obj.get("status", {}).get("observedGeneration")
            if observed != obj["metadata"]["generation"]:
                return False
            live = self.pods(name, namespace)
            return bool(live) and not set(live) & set(old_pods)

        self.wait_ready(name, namespace, until=rolled, what="rolled out to new pods")
        return self.pods(name, namespace)

    def pods(self, name: str, namespace: str) -> list[str]:
        """The InferenceDeployment's live pods. A pod the kubelet refused at admission (e.g. the
        device plugin re-registering after a kubelet restart) stays behind as Failed while its
        ReplicaSet replaces it; it serves nothing, so it is not counted."""
        obj = json.loads(self.run_kubectl("get", "infd", name, "-n", namespace, "-o", "json"))
        selector = obj["status"]["selector"]
        out = self.run_kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
        live = []
        for pod in json.loads(out)["items"]:
            phase = pod["status"].get("phase")
            if pod["metadata"].get("deletionTimestamp") or phase in ("Failed", "Succeeded"):
                print(f"    not live: {pod['metadata']['name']} {phase}", file=sys.stderr)
                continue
            live.append(str(pod["metadata"]["name"]))
        return live

    def container_env(self, pod: str, namespace: str, *names: str) -> dict[str, str]:
        out = self.run_kubectl("exec", "-n", namespace, pod, "-c", "runtime", "--", "env")
        env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return {k: env[k] for k in names if k in env}

    def get_columns(self, name: str, namespace: str) -> dict[str, str]:
        """`kubectl get infd NAME` as {COLUMN: value} (see `table_columns`)."""
        return table_columns(self.run_kubectl("get", "infd", name, "-n", namespace))

    def wait_columns(
        self,
        name: str,
        namespace: str,
        want: Callable[[dict[str, str]], bool],
        what: str,
        *,
        timeout: float = 90,
        poll: float = 1,
    ) -> dict[str, str]:
        echo = Echo()
        with timed(f"waiting until `kubectl get infd {name}` shows {what}"):
            cols: dict[str, str] = wait_for(
                f"`kubectl get infd {name}` to show {what}",
                lambda: echo(self.get_columns(name, namespace)),
                timeout,
                poll,
                until=want,
            )
            return cols

    def heat_and_cool(self, name: str, namespace: str) -> tuple[dict[str, str], dict[str, str]]:
        """Heat the fake sensor, see the batch shrink in `kubectl get infd`, cool, see it back.

        The manifest's batch is 8, throttling starts at 78 °C, one step per 2 °C: 87 °C → 4
        (below the 90 °C critical mark, so the replica stays where it is).
        """
        step(f"heating the fake sensor on {self.target.node_name()} to {HOT_CELSIUS} °C")
        self.set_temperature(HOT_CELSIUS)
        hot = self.wait_columns(name, namespace, lambda c: c.get("BATCH") == "4", "BATCH 4")
        step(f"cooling it to {COOL_CELSIUS} °C")
        self.set_temperature(COOL_CELSIUS)
        cool = self.wait_columns(name, namespace, lambda c: c.get("BATCH") == "8", "BATCH 8")
        return hot, cool

    # -- a full node ------------------------------------------------------------------------
    def free_cpu(self) -> Fraction:
        """The serving node's allocatable CPU minus what its live pods request."""
        node = self.target.node_name()
        obj = json.loads(self.run_kubectl("get", "node", node, "-o", "json"))
        free = quantity.parse(obj["status"]["allocatable"]["cpu"])
        selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
        pods = self.run_kubectl("get", "pods", "-A", "--field-selector", selector, "-o", "json")
        for pod in json.loads(pods)["items"]:
            free -= _pod_cpu(pod["spec"])
        return free

    def replica_cpu(self, name: str, namespace: str) -> Fraction:
        """The CPU one replica of the InferenceDeployment requests (from its Deployment)."""
        deploy = json.loads(self.run_kubectl("get", "deploy", name, "-n", namespace, "-o", "json"))
        return _pod_cpu(deploy["spec"]["template"]["spec"])

    @contextlib.contextmanager
    def node_full_for(self, cpu: Fraction, namespace: str) -> Iterator[None]:
        """Leave less than `cpu` free on the serving node for the duration (a pause pod takes
        the rest), so a second replica of that size cannot be scheduled there."""
        spare = self.free_cpu() - cpu / 2
        name = "ember-e2e-filler"
        if spare > 0:
            requests = {"cpu": f"{math.floor(spare * 1000)}m"}
            self.apply(filler_pod(name, namespace, self.target.node_name(), requests))
        try:
            yield
        finally:
            self.run_kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found")

    # -- talking to it -------------------------------------------------------------------
    def port_forward(
        self, service: str, namespace: str, port: int
    ) -> contextlib.AbstractContextManager[int]:
        return port_forward(self.kubectl, self.target.kubeconfig, service, namespace, port)

    def wait_gateway(self, local_port: int, model: str, timeout: float = 60) -> list[str]:
        """Until the gateway behind `local_port` lists `model` and is Ready (a replica of it
        answers the gateway's probes); returns the models it lists."""
        base = f"http://127.0.0.1:{local_port}"
        listed: list[str] = []

        def routed() -> bool:
            listed[:] = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=5).json()["data"]]
            return model in listed and httpx.get(f"{base}/readyz", timeout=5).status_code == 200

        with timed(f"waiting for the gateway to route {model}"):
            wait_for(f"the gateway routing {model}", routed, timeout, 0.2, tolerate=(Exception,))
        return listed

    def chat(self, local_port: int, prompt: str, on_token: Callable[[str], None]) -> str:
        """A streamed /v1/chat/completions request (the model's chat template)."""
        messages = [{"role": "user", "content": prompt}]
        return self._stream(local_port, "chat/completions", {"messages": messages}, on_token)

    def complete(self, local_port: int, prompt: str, on_token: Callable[[str], None]) -> str:
        """A streamed /v1/completions request (plain text continuation)."""
        return self._stream(local_port, "completions", {"prompt": prompt}, on_token)

    def embed(self, local_port: int, inputs: list[str]) -> list[list[float]]:
        """A /v1/embeddings request; the vectors in input order (checked by their index)."""
        url = f"http://127.0.0.1:{local_port}/v1/embeddings"
        body = {"model": "gemma-3-270m", "input": inputs, "encoding_format": "float"}
        resp = httpx.post(url, json=body, timeout=120)
        resp.raise_for_status()
        data = resp.json()["data"]
        if [d["index"] for d in data] != list(range(len(inputs))):
            raise AssertionError(f"embeddings out of order: {[d['index'] for d in data]}")
        return [d["embedding"] for d in data]

    def _stream(
        self, local_port: int, path: str, fields: dict[str, Any], on_token: Callable[[str], None]
    ) -> str:
        body = {"model": "gemma-3-270m", "stream": True, "max_tokens": 48, "temperature": 0}
        text = []
        url = f"http://127.0.0.1:{local_port}/v1/{path}"
        with httpx.stream("POST", url, json={**body, **fields}, timeout=120) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                text.append(delta)
                on_token(delta)
        return "".join(text)

    # -- diagnostics ---------------------------------------------------------------------
    @contextlib.contextmanager
    def dumping(self, namespace: str) -> Iterator[None]:
        """On any failure inside, print events, `describe` and logs first."""
        try:
            yield
        except BaseException:
            print(self.dump(namespace), flush=True)
            raise

    def dump(self, namespace: str) -> str:
        """Events, describe and logs: what a failing run prints."""
        parts = []
        for args in (
            ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
            ("describe", "infd", "-n", namespace),
            ("describe", "pods", "-n", namespace),
            (
                "logs",
                "-n",
                namespace,
                "-l",
                "app.kubernetes.io/managed-by=ember-operator",
                "--all-containers",
                "--tail=40",
            ),
            ("logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=operator", "--tail=60"),
            ("logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=deviceplugin"),
            ("logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=gateway", "--tail=40"),
            ("describe", "node"),
        ):
            parts.append(f"--- kubectl {' '.join(args)}\n" + self.run_kubectl(*args, check=False))
        return "\n".join(parts)


def table_columns(table: str) -> dict[str, str]:
    """The first row of a `kubectl get` table as {COLUMN: value}, cut at the header's column
    offsets: an empty cell (TEMP before any reading) must not shift the columns after it."""
    header, row = table.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = zip(starts, [*starts[1:], None], strict=True)
    return {header.split()[i]: row[a:b].strip() for i, (a, b) in enumerate(bounds)}


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    found = _find_condition(obj, kind)
    return None if found is None else str(found.get("status"))


def _find_condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == kind:
            return dict(cond)
    return None


@dataclass
class Echo:
    """Prints each value unlike the one before: a wait's progress, on stderr."""

    last: Any = None

    def __call__(self, value: Any) -> Any:
        if value != self.last:
            print(f"    {value}", file=sys.stderr, flush=True)
            self.last = value
        return value


class DegradedError(RuntimeError):
    """The InferenceDeployment stayed Degraded for one reason: waiting longer will not help."""


@dataclass
class DegradedClock:
    """How long the object's current `Degraded` reason has stood (monotonic seconds)."""

    grace: float = DEGRADED_GRACE_SECONDS
    clock: Callable[[], float] = time.monotonic
    reason: str | None = None
    since: float = 0.0

    def update(self, obj: dict[str, Any]) -> str | None:
        """Feed the latest object; returns "Degraded <reason>: <message>" once one reason has
        stood for `grace` seconds, else None."""
        cond = _find_condition(obj, "Degraded")
        reason = cond.get("reason") if cond and cond.get("status") == "True" else None
        now = self.clock()
        if reason != self.reason:
            self.reason, self.since = reason, now
        if reason is None or cond is None or now - self.since < self.grace:
            return None
        return f"Degraded {reason}: {cond.get('message', '')}"


def filler_pod(name: str, namespace: str, node: str, requests: dict[str, str]) -> dict[str, Any]:
    """A pause pod on `node` that holds `requests` of it (a node made full on purpose)."""
    container = {
        "name": "pause",
        "image": PAUSE_IMAGE,
        "imagePullPolicy": "Never",
        "resources": {"requests": requests},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": node, "containers": [container]},
    }


def _pod_cpu(pod_spec: dict[str, Any]) -> Fraction:
    """A pod's effective CPU request, as the scheduler counts it: the larger of the sum over
    its containers and any one init container."""

    def cpu(container: dict[str, Any]) -> Fraction:
        requests = container.get("resources", {}).get("requests", {})
        return quantity.parse(requests.get("cpu", "0"))

    main = sum((cpu(c) for c in pod_spec.get("containers", [])), Fraction(0))
    return max([main, *(cpu(c) for c in pod_spec.get("initContainers", []))])


def copy_model(src: Path, dest_dir: Path) -> None:
    """Local node: the node's filesystem is this machine's."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / MODEL_FILE
    if not dest.exists() or dest.stat().st_size != src.stat().st_size:
        tmp = dest.with_suffix(".partial")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
    # The runtime runs as a non-root user: the files must be readable by it.
    for path in (dest_dir, dest):
        path.chmod(0o755 if path.is_dir() else 0o644)
    os.sync()
