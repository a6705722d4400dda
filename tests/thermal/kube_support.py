"""Helpers for the node-side thermal tests on the real API server: the chart's runtime RBAC and
admission policy, a pod bound token (TokenRequest), and a TCP proxy we can cut to take the API
server away from one client without stopping it for everyone else."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.cluster.build import ensure_binaries
from tests.conftest import Kube

CHART = Path(__file__).resolve().parents[2] / "charts" / "ember"
RUNTIME_SA = "ember-runtime"
# helm template's names for release "ember": the operator's default runtime_cluster_role.
RUNTIME_ROLE = "ember-runtime"
RUNTIME_POLICY = "ember-runtime-own-pod"
# The node agent's objects, one kind per template.
NODEAGENT_TEMPLATES = tuple(
    f"nodeagent-{kind}.yaml"
    for kind in (
        "serviceaccount",
        "clusterrole",
        "clusterrolebinding",
        "role",
        "rolebinding",
        "validatingadmissionpolicy",
        "validatingadmissionpolicybinding",
        "daemonset",
    )
)


def chart_objects(*templates: str, namespace: str = "ember-system") -> list[dict[str, Any]]:
    helm = str(ensure_binaries() / "helm")
    argv = [helm, "template", "ember", str(CHART), "--namespace", namespace]
    argv += ["--kube-version", "1.36.3"]
    for template in templates:
        argv += ["--show-only", f"templates/{template}"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def kubectl_apply(kube: Kube, objects: list[dict[str, Any]], tmp: Path) -> None:
    path = tmp / "objects.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))


@contextlib.contextmanager
def runtime_policy(kube: Kube, tmp: Path) -> Iterator[None]:
    """The chart's runtime ClusterRole + ValidatingAdmissionPolicy (+ binding), as installed."""
    wanted = {"ClusterRole": RUNTIME_ROLE}
    objects = [
        o
        for o in chart_objects("rbac.yaml", "thermal-admission.yaml")
        if o["kind"] not in wanted or o["metadata"]["name"] == wanted[o["kind"]]
    ]
    objects = [o for o in objects if o["kind"] != "ClusterRoleBinding"]
    kubectl_apply(kube, objects, tmp)
    try:
        yield
    finally:
        for o in objects:
            kind = o["kind"].lower()
            kube.kubectl("delete", kind, o["metadata"]["name"], "--ignore-not-found")


def parked_pod(name: str, labels: dict[str, str] | None = None) -> Any:
    """A pod of the runtime's ServiceAccount that no node will run (nothing else writes it but
    the scheduler, once: PodScheduled=False)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "thermal-test"}},
        "spec": {
            "serviceAccountName": RUNTIME_SA,
            "automountServiceAccountToken": False,
            "nodeSelector": {"ember.dev/nowhere": "true"},
            "containers": [{"name": "runtime", "image": "ember-runtime:never"}],
        },
    }


def pod_token(core: client.CoreV1Api, namespace: str, pod: Any, seconds: int = 900) -> str:
    """A token bound to `pod`, as the kubelet would project it: its user info names the pod."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],
            expiration_seconds=seconds,
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
            ),
        )
    )
    answer: Any = core.create_namespaced_service_account_token(RUNTIME_SA, namespace, request)
    return str(answer.status.token)


def token_dir(kube: Kube, token: str, where: Path) -> Path:
    """A directory shaped like a pod's serviceaccount mount: token and ca.crt."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "token").write_text(token)
    shutil.copy(kube.api.configuration.ssl_ca_cert, where / "ca.crt")
    return where


def api_server(kube: Kube) -> tuple[str, int]:
    host = str(kube.api.configuration.host).removeprefix("https://")
    name, _, port = host.rpartition(":")
    return name, int(port)


class TcpProxy:
    """127.0.0.1:<port> → the API server. `cut()` refuses new connections and drops the open
    ones (the API server is gone, for whoever goes through here); `restore()` brings it back on
    the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def restore(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        if self._listener is not None:
            # shutdown() first: on Linux, close() alone does not wake a thread blocked in
            # accept(), which would go on accepting on the "closed" socket.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._open += [downstream, upstream]
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
