"""Session fixtures for the real local cluster (see tests/cluster/).

- `kube`: control plane (etcd, kube-apiserver, controller-manager, scheduler) + kwok, with a
  client and a kubectl helper.
- `node`: the real kubelet node (containerd + runc + CNI) — device plugins register here.
- `fleet(n, sites=5)`: n kwok fake nodes, tainted `ember.dev/simulated=true:NoSchedule`
  (pods opt in with `tests.cluster.fleet.SIM_TOLERATION`).
- `namespace`: a fresh namespace per test, deleted afterwards.

If the cluster cannot start, every test that needs it errors loudly; nothing is skipped.
A cluster that was already running (`python -m tests.cluster up`) is reused and left running;
one the session started is torn down at the end unless EMBER_KEEP_CLUSTER=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.config import kube_config

from tests.cluster.cluster import DEVICE_PLUGIN_DIR, NODE_NAME, POD_RESOURCES_SOCKET, Cluster
from tests.cluster.fleet import ensure_fleet
from tests.cluster.images import BASE_IMAGE
from tests.cluster.paths import bin_dir
from tests.support.waiting import wait_for


@dataclass
class Kube:
    cluster: Cluster
    kubeconfig: Path
    api: client.ApiClient

    def kubectl(self, *args: str) -> str:
        """Run kubectl against the local cluster; raises with stderr on failure."""
        return self.cluster.kubectl(*args)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)


@dataclass
class NodeHandle:
    kube: Kube
    name: str = NODE_NAME
    device_plugin_dir: Path = DEVICE_PLUGIN_DIR
    pod_resources_socket: Path = POD_RESOURCES_SOCKET
    base_image: str = BASE_IMAGE

    def restart_kubelet(self) -> None:
        self.kube.cluster.node.restart_kubelet()
        self.kube.cluster.node.up()


_STARTED_BY_SESSION: dict[str, bool] = {}


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    _STARTED_BY_SESSION["cp"] = not cluster.is_up(with_node=False)
    if _STARTED_BY_SESSION["cp"]:
        # Leftovers of a cluster that was killed rather than stopped (stale mounts, sandboxes,
        # the bridge) would confuse the new one: clear them first.
        cluster.down()
    yield cluster
    keep = os.environ.get("EMBER_KEEP_CLUSTER") == "1"
    if not keep and (_STARTED_BY_SESSION.get("cp") or _STARTED_BY_SESSION.get("node")):
        cluster.down()


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Kube:
    cluster.up(with_node=False)
    # In-process clients (Kopf under KopfRunner, the operator's own client) find the cluster
    # through $KUBECONFIG; the kubernetes library read that variable once, at import time.
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cluster.kubeconfig)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    kube = Kube(cluster=cluster, kubeconfig=cluster.kubeconfig, api=api)
    clear_leftovers(kube)
    return kube


def clear_leftovers(kube: Kube) -> None:
    """Start from a state the suite controls, whatever ran before on a reused cluster.

    `make demo` leaves Ember installed (its operator would act on the suite's objects beside
    the operator under test) and an InferenceDeployment whose replica holds a CPU of the real
    node (the e2e's replica could not be scheduled). Both are removed; the README says so.
    """
    kubectl = kube.cluster.kubectl
    objs = kubectl("get", "infd", "-A", "-o", "name", check=False).split()
    if objs:
        print(f"deleting InferenceDeployments left on the cluster: {' '.join(objs)}")
        kubectl("delete", "infd", "--all", "-A", "--wait=false")
    _uninstall_ember_releases(kube)
    _delete_stray_gateway_rbac(kube)
    # An operator that is gone (uninstalled above, or a killed test run) cannot lift the
    # finalizer Kopf put on its objects; nothing of theirs lives outside the cluster (children
    # go by garbage collection), so lifting it here loses nothing.
    stuck = json.loads(kubectl("get", "infd", "-A", "-o", "json", check=False) or "{}")
    for obj in stuck.get("items", []):
        meta = obj["metadata"]
        patch = '{"metadata":{"finalizers":null}}'
        kubectl(
            "patch",
            "infd",
            meta["name"],
            "-n",
            meta["namespace"],
            "--type=merge",
            "-p",
            patch,
            check=False,
        )
    # Their pods go by garbage collection; wait until the node's CPUs are free again.
    selector = "app.kubernetes.io/managed-by=ember-operator"

    def left() -> str:
        objs = kubectl("get", "infd", "-A", "-o", "name", check=False)
        pods = kubectl("get", "pods", "-A", "-l", selector, "-o", "name", check=False)
        return (objs + pods).strip()

    what = "the leftover InferenceDeployments and their pods to go"
    wait_for(what, left, 180, 1, until=lambda names: not names)


def _delete_stray_gateway_rbac(kube: Kube) -> None:
    """The gateway's cluster-wide RBAC a killed cluster test applied (`kube_site.
    applied_gateway_rbac`) and never removed: owned by no Helm release (those were uninstalled
    just before), it would make every later `helm install` with gateway sites fail."""
    for kind in ("clusterrole", "clusterrolebinding"):
        out = kube.cluster.kubectl("get", kind, "ember-gateway-nodes", "-o", "json", check=False)
        annotations = (json.loads(out or "{}").get("metadata") or {}).get("annotations") or {}
        if out and "meta.helm.sh/release-name" not in annotations:
            print(f"deleting the {kind} ember-gateway-nodes a killed test left")
            kube.cluster.kubectl("delete", kind, "ember-gateway-nodes", "--ignore-not-found")


def _uninstall_ember_releases(kube: Kube) -> None:
    helm = [str(bin_dir() / "helm"), f"--kubeconfig={kube.kubeconfig}"]
    listed = subprocess.run([*helm, "list", "-A", "-o", "json"], capture_output=True, check=False)
    for release in json.loads(listed.stdout or "[]") if listed.returncode == 0 else []:
        if release.get("chart", "").startswith("ember-"):
            name, ns = release["name"], release["namespace"]
            print(f"removing Helm release {ns}/{name} left running")
            uninstall = [*helm, "uninstall", name, "-n", ns, "--wait", "--timeout", "180s"]
            subprocess.run(uninstall, check=True, capture_output=True)


@pytest.fixture(scope="session")
def node(kube: Kube) -> NodeHandle:
    _STARTED_BY_SESSION["node"] = not kube.cluster.is_up(with_node=True)
    kube.cluster.node.up()
    return NodeHandle(kube=kube)


@pytest.fixture(scope="session")
def fleet(kube: Kube) -> Callable[..., list[str]]:
    def make(n: int, sites: int = 5) -> list[str]:
        return ensure_fleet(kube.api, n, sites)

    return make


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    kube.core.delete_namespace(name, grace_period_seconds=0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # On failure of a cluster test, attach the components' log tails: the first thing to read.
    if report.failed and "kube" in getattr(item, "fixturenames", ()):
        report.sections.append(("cluster logs", Cluster().diagnostics()))
    return report
