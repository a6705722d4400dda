"""A site of node agents on the real API server, for the site-sharing test and benchmark.

`SiteWorld` applies the chart's node-agent objects (RBAC, the admission policies) into a
namespace, creates plain Node objects labelled `ember.dev/site` with
the InternalIP each agent serves on, an InferenceDeployment (`MODEL`, CRD installed from crds/)
whose http source is what the agents fetch, one pod per node naming it the way the operator's
pods do (label `ember.dev/instance`, annotation `ember.dev/model-fetch-hash`; the pod is also
the object the agent's token is bound to, so the token's
`authentication.kubernetes.io/node-name` is that node), and starts the real agent
(`python -m ember_runtime.nodeagent`) as a process per node, optionally inside a network
namespace (`ip netns exec`). Nothing about Kubernetes is faked: the agents talk to the
API server with their own bound tokens, through the chart's policies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL
from ember_runtime.contract.config import fetch_from_spec
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.site import ORIGIN_SLOT, SHORT, lease_name
from kubernetes import client

from tests.conftest import Kube
from tests.support.waiting import wait_for
from tests.thermal.kube_support import NODEAGENT_TEMPLATES, chart_objects, kubectl_apply, token_dir

AGENT_SA = "ember-nodeagent"
POLICY_RELOAD_SECONDS = 2.5
POLICY = "validatingadmissionpolicy"
LEASE_POLICY = "ember-nodeagent-own-leases"  # holds the node -> site map
# The chart's siteSharing.siteLabel: what the agents read their site from.
TRUSTED_SITE_LABEL = "node-restriction.kubernetes.io/ember-site"
ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
MODEL = "fetched"  # the InferenceDeployment the site's pods belong to
GROUP, VERSION, PLURAL = "ember.dev", "v1alpha1", "inferencedeployments"
AGENT_PYTHONPATH = "EMBER_TEST_AGENT_PYTHONPATH"
LEGACY_FETCH_ANNOTATION = "ember.dev/model-fetch"


def site_node(name: str, site: str, ip: str) -> dict[str, Any]:
    """A Node with no kubelet behind it: a name, a site label and an InternalIP."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "ember.dev/site": site,
                TRUSTED_SITE_LABEL: site,
                "type": "site-test",
            },
        },
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }


def model_spec(files: Sequence[dict[str, Any]], secret: str | None = None) -> dict[str, Any]:
    """`spec.model` with an http source for `files` ({url, sha256, sizeBytes} each)."""
    paths = [f"f{i}.gguf" for i in range(len(files))]
    http: dict[str, Any] = {"urls": {p: f["url"] for p, f in zip(paths, files, strict=True)}}
    if secret is not None:
        http["secretRef"] = {"name": secret}
    return {
        "name": "m",
        "source": {"http": http},
        "files": [
            {"path": p, "sha256": f["sha256"], "sizeBytes": f["sizeBytes"]}
            for p, f in zip(paths, files, strict=True)
        ],
    }


def inference_deployment(name: str, model: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"model": model},
    }


def claim_metadata(name: str, model: dict[str, Any]) -> dict[str, Any]:
    """What the operator's pods carry: the InferenceDeployment's name and its fetch digest."""
    fetch = fetch_from_spec(model)
    assert fetch is not None
    annotations = {FETCH_HASH_ANNOTATION: fetch.digest()}
    if os.environ.get(AGENT_PYTHONPATH):
        # An agent from before issue 34 took what to fetch from this pod annotation (anyone's
        # to write: hole 1). Written only when running such an agent, to show a test fails on it.
        legacy = fetch.model_dump_json(by_alias=True, exclude_none=True)
        annotations[LEGACY_FETCH_ANNOTATION] = legacy
    return {"labels": {INSTANCE_LABEL: name}, "annotations": annotations}


def put_inference_deployment(kube: Kube, namespace: str, name: str, model: dict[str, Any]) -> None:
    """Create the object, or replace its spec.model."""
    api = client.CustomObjectsApi(kube.api)
    try:
        obj: Any = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as err:
        if err.status != 404:
            raise
        body = inference_deployment(name, model)
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        return
    obj["spec"]["model"] = model
    api.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, obj)


def install_crds(kube: Kube) -> None:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")


def fetch_pod(name: str, node: str, files: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if files is not None:
        metadata.update(claim_metadata(MODEL, model_spec(files)))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "serviceAccountName": AGENT_SA,
            "automountServiceAccountToken": False,
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "agent", "image": "ember-runtime:never"}],
        },
    }


@dataclass
class Agent:
    node: str
    cache: ContentCache
    log: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class SiteWorld:
    kube: Kube
    namespace: str
    tmp: Path
    site: str = field(default_factory=lambda: f"site-{uuid.uuid4().hex[:6]}")
    agents: list[Agent] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    _objects: list[dict[str, Any]] = field(default_factory=list)

    def __enter__(self) -> SiteWorld:
        """Installed (and closed again if installing fails part-way)."""
        try:
            self.install()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def install(self) -> None:
        """The chart's node-agent objects (not the DaemonSet) for `namespace`."""
        self._objects = [
            o
            for o in chart_objects(*NODEAGENT_TEMPLATES, namespace=self.namespace)
            if o["kind"] != "DaemonSet"
        ]
        kubectl_apply(self.kube, self._objects, self.tmp)
        install_crds(self.kube)

    def add_nodes(
        self, ips: Sequence[str], site: str | None = None, *, map_sites: bool = True
    ) -> list[str]:
        """Nodes of `site` (default: the world's), entered in the Lease policy's map as the
        chart (at install) or an operator (later) would; returns every node so far."""
        site = site or self.site
        start = len(self.nodes)
        for i, ip in enumerate(ips, start):
            name = f"{self.site}-n{i}"
            body: Any = site_node(name, site, ip)
            self.kube.core.create_node(body)
            self.nodes.append(name)
        if map_sites:
            self.map_sites({n: site for n in self.nodes[start:]})
        return list(self.nodes)

    def map_sites(self, sites: dict[str, str]) -> None:
        """Add node -> site to the Lease policy's map, as a chart upgrade (or an operator)
        would write it: the site as Lease names spell it."""
        path = self.tmp / "own-leases.json"
        policy = json.loads(self.kube.kubectl("get", POLICY, LEASE_POLICY, "-o", "json"))
        (var,) = [v for v in policy["spec"]["variables"] if v["name"] == "sites"]
        known = json.loads(var["expression"])
        for node, site in sites.items():
            known[node] = lease_name(site, "0" * 64)[len("ember-fetch-") : -(SHORT + 1)]
        var["expression"] = json.dumps(known)
        path.write_text(json.dumps(policy))
        self.kube.kubectl("replace", "-f", str(path))
        # The API server reloads changed admission policies on a 1 s tick ("refreshing
        # policies"): a Lease write straight after this could still meet the old map (a 403
        # that failed a test once in a full run).
        time.sleep(POLICY_RELOAD_SECONDS)

    def want(self, files: Sequence[dict[str, Any]] | None) -> None:
        """One pod per node wanting `files` (what the agents fetch; None: nothing yet)."""
        if files is not None:
            put_inference_deployment(self.kube, self.namespace, MODEL, model_spec(files))
        for node in self.nodes:
            name = f"{node}-{uuid.uuid4().hex[:4]}"
            pod: Any = fetch_pod(name, node, files)
            self.kube.core.create_namespaced_pod(self.namespace, pod)
            self.pods.append(name)

    def announce(self, files: Sequence[dict[str, Any]]) -> None:
        """Every node's pod now wants `files` (the agents see the change on their watch)."""
        model = model_spec(files)
        put_inference_deployment(self.kube, self.namespace, MODEL, model)
        body = {"metadata": claim_metadata(MODEL, model)}
        for pod in self.pods:
            self.kube.core.patch_namespaced_pod(pod, self.namespace, body)

    def _token(self, node: str) -> Path:
        pod_name = next(p for p in self.pods if p.startswith(f"{node}-"))
        pod: Any = self.kube.core.read_namespaced_pod(pod_name, self.namespace)
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=3600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name=pod_name, uid=pod.metadata.uid
                ),
            )
        )
        answer: Any = self.kube.core.create_namespaced_service_account_token(
            AGENT_SA, self.namespace, request
        )
        return token_dir(self.kube, str(answer.status.token), self.tmp / f"sa-{node}")

    def start(
        self,
        server: str,
        *,
        extra: Sequence[str] = (),
        prefix: Callable[[int], list[str]] = lambda i: [],
        peer_bind: str = "127.0.0.1",
        peer_port: int = 0,
        sharing: bool = True,
        only: Sequence[str] | None = None,
    ) -> list[Agent]:
        """The real agent per node (or per node in `only`); `prefix(i)` wraps its argv (e.g.
        `ip netns exec nsI`)."""
        (self.tmp / "sys").mkdir(exist_ok=True)
        # AGENT_PYTHONPATH runs another checkout's agent against these tests (how a test is
        # shown to fail on the code before a fix); by default this checkout's.
        path = os.environ.get(AGENT_PYTHONPATH) or f"{ROOT}/runtime:{ROOT}"
        env = {**os.environ, "PYTHONPATH": path}
        for i, node in enumerate(self.nodes):
            if only is not None and node not in only:
                continue
            sa = self._token(node)
            cache = ContentCache(self.tmp / f"cache-{node}")
            argv = [
                *prefix(i),
                sys.executable,
                "-m",
                "ember_runtime.nodeagent",
                f"--node_name={node}",
                f"--server={server}",
                f"--token_file={sa / 'token'}",
                f"--ca_file={sa / 'ca.crt'}",
                f"--cache_root={cache.root}",
                f"--namespace={self.namespace}",
                f"--sysfs_root={self.tmp / 'sys'}",
                f"--site_label={TRUSTED_SITE_LABEL}",
                "--interval_seconds=60",
                *(
                    [
                        "--site_sharing=true",
                        f"--peer_bind={peer_bind}",
                        f"--peer_port={peer_port}",
                    ]
                    if sharing
                    else []
                ),
                *extra,
            ]
            log = self.tmp / f"agent-{node}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            self.agents.append(Agent(node, cache, log, proc))
        return self.agents

    def logs(self) -> str:
        return "\n".join(f"--- {a.node}\n{a.log.read_text()}" for a in self.agents)

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> float:
        """Seconds until `done()`; fails (with the agents' logs) at `timeout` or as soon as an
        agent exits."""

        def check() -> bool:
            if done():
                return True
            for a in self.agents:
                if a.proc is not None and a.proc.poll() is not None:
                    raise AssertionError(f"agent {a.node} exited\n{self.logs()}")
            return False

        started = time.monotonic()
        wait_for(what, check, timeout, 0.1, on_fail=self.logs)
        return time.monotonic() - started

    def stop_agents(self) -> list[int]:
        """SIGTERM every agent; their exit codes (0 = stopped cleanly)."""
        codes = []
        for a in self.agents:
            if a.proc is not None and a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        for a in self.agents:
            if a.proc is not None:
                try:
                    codes.append(a.proc.wait(timeout=30))
                except subprocess.TimeoutExpired:
                    a.proc.kill()
                    codes.append(-9)
        return codes

    def leases(self) -> list[Any]:
        listed: Any = client.CoordinationV1Api(self.kube.api).list_namespaced_lease(self.namespace)
        slot = lease_name(self.site, ORIGIN_SLOT)  # the site's origin slot is not a file's
        return [
            i
            for i in listed.items
            if i.metadata.name.startswith("ember-fetch-") and i.metadata.name != slot
        ]

    def close(self) -> None:
        self.stop_agents()
        for node in self.nodes:
            self.kube.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")
        for o in self._objects:
            if "namespace" not in o["metadata"]:
                kind = o["kind"].lower()
                self.kube.kubectl("delete", kind, o["metadata"]["name"], "--ignore-not-found")
