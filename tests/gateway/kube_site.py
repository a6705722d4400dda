"""A gateway's site on the real API server, for the gateway's cluster tests: the chart's gateway
RBAC, a token of the gateway's ServiceAccount, and replica pods on kwok nodes (kwok makes them
Ready; kwok pods run no process, so a test that needs a replica behind a pod points the pod's IP
at a runtime it started, with `point_at`)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.cluster.build import ensure_binaries
from tests.cluster.fleet import SIM_TOLERATION
from tests.conftest import Kube
from tests.support.waiting import wait_for
from tests.thermal.kube_support import CHART, kubectl_apply, token_dir

SA = "ember-gateway"


@contextlib.contextmanager
def applied_gateway_rbac(
    kube: Kube, namespace: str, site: str, key_secrets: tuple[str, ...], tmp: Path
) -> Iterator[None]:
    """`gateway_rbac` applied for the duration. The namespace takes its own objects along; the
    chart's ClusterRole and binding would outlive it and block every later `helm install` with
    the gateway's sites ("ClusterRole ember-gateway-nodes exists and cannot be imported into
    the current release"), so they are deleted here."""
    rbac = gateway_rbac(namespace, site, key_secrets)
    kubectl_apply(kube, rbac, tmp)
    try:
        yield
    finally:
        for obj in rbac:
            if obj["kind"].startswith("Cluster"):
                kind, name = obj["kind"].lower(), obj["metadata"]["name"]
                kube.kubectl("delete", kind, name, "--ignore-not-found")


def gateway_rbac(namespace: str, site: str, key_secrets: tuple[str, ...]) -> list[dict[str, Any]]:
    """The chart's gateway objects but its Deployment and Service: ServiceAccount, Role and
    binding, reading `key_secrets` (the Secrets holding the models' API keys) and nothing else."""
    argv = [str(ensure_binaries() / "helm"), "template", "ember", str(CHART), "-n", namespace,
            "--kube-version", "1.36.3", "--show-only", "templates/gateway.yaml",
            "--set", "gateway.enabled=true", "--set", f"gateway.sites[0].name={site}"]  # fmt: skip
    if key_secrets:  # helm refuses an empty list in --set
        argv += ["--set", f"gateway.apiKeySecrets={{{','.join(key_secrets)}}}"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return [d for d in docs if d["kind"] not in ("Deployment", "Service")]


def gateway_token(kube: Kube, namespace: str, where: Path) -> Path:
    """A serviceaccount-shaped directory (token, ca.crt) with a token of the gateway's SA."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    )
    answer: Any = kube.core.create_namespaced_service_account_token(SA, namespace, request)
    return token_dir(kube, str(answer.status.token), where)


def pod(name: str, instance: str, node: str) -> dict[str, Any]:
    """A replica pod of InferenceDeployment `instance`, bound to kwok node `node`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"ember.dev/instance": instance}},
        "spec": {
            "nodeName": node,
            "tolerations": [SIM_TOLERATION],
            "containers": [{"name": "runtime", "image": "ember-runtime:never"}],
        },
    }


def ips(kube: Kube, namespace: str, names: list[str], timeout: float = 60) -> dict[str, str]:
    """The pods' IPs once kwok has made them Ready."""

    def ready_ips() -> dict[str, str]:
        found: dict[str, str] = {}
        for name in names:
            got: Any = kube.core.read_namespaced_pod(name, namespace)
            ready = any(
                c.type == "Ready" and c.status == "True" for c in got.status.conditions or []
            )
            if ready and got.status.pod_ip:
                found[name] = got.status.pod_ip
        return found

    what = f"kwok to make {names} ready"
    found: dict[str, str] = wait_for(
        what, ready_ips, timeout, 0.5, until=lambda f: len(f) == len(names)
    )
    return found


def point_at(kube: Kube, namespace: str, name: str, ip: str) -> None:
    """Give a Ready kwok pod the IP of a runtime this machine runs (a loopback address). kwok
    assigns an IP only to a pod without one, so it leaves this one alone."""
    patch = [
        {"op": "replace", "path": "/status/podIP", "value": ip},
        {"op": "replace", "path": "/status/podIPs", "value": [{"ip": ip}]},
    ]
    kube.core.patch_namespaced_pod_status(name, namespace, patch)  # type: ignore[arg-type]
