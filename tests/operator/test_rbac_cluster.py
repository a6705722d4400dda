"""The operator on the chart's RBAC, nothing more: any call the chart forgot is a 403, and a
403 anywhere in its log fails the test.

`helm template` renders the chart's ServiceAccount and ClusterRoles (release "rbac"); they are
applied to the real API server, and `python -m ember_operator` runs as a separate process with
the args and env of the chart's operator Deployment and a token of that ServiceAccount (the
admin kubeconfig is not in its environment). The flow touches every rule: create (children,
the runtime's ServiceAccount and RoleBinding, status), scale 2 → 1 (the PDB deleted), a deleted
child re-created, a hot node (taint, eviction, Events, the node agent's report, release), and
deletion. Two value sets: the default (cluster-wide, one replica, --standalone) and two peering
replicas watching one namespace (Kopf's namespace and peering calls).

A flow step whose call is forbidden also times out; the log check catches the calls whose
failure is only logged (Events, Kopf's fallbacks when it may not watch CRDs or namespaces).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from ember_operator.thermal.actions import HOT_TAINT_KEY
from ember_runtime.contract.thermal import ThermalReading, thermal_condition
from kubernetes import client

from tests.cluster.build import ensure_binaries
from tests.cluster.fleet import SIM_TOLERATION, create_nodes, node_manifest, wait_schedulable
from tests.conftest import Kube
from tests.e2e.flow import REFUSED
from tests.operator import rest
from tests.operator.specs import fleet_manifest
from tests.support.net import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "ember"
RELEASE = "rbac"
PRIVATE = {"key": "ember.dev/rbac-test", "value": "true", "effect": "NoSchedule"}
RBAC_TEMPLATES = ("templates/rbac.yaml", "templates/serviceaccount.yaml")


def render(namespace: str, *values: str) -> list[dict[str, Any]]:
    """The chart's RBAC objects and operator Deployment, as `helm install` would create them."""
    argv = [str(ensure_binaries() / "helm"), "template", RELEASE, str(CHART)]
    argv += ["--namespace", namespace, "--kube-version", "1.36.3"]
    argv += ["--set", f"operator.metricsPort={free_port()}"]
    argv += ["--set", f"operator.livenessPort={free_port()}"]
    for value in values:
        argv += ["--set", value]
    for template in (*RBAC_TEMPLATES, "templates/operator-deployment.yaml"):
        argv += ["--show-only", template]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _kubeconfig(kube: Kube, token: str, where: Path) -> Path:
    conf = kube.api.configuration
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": conf.host, "certificate-authority": conf.ssl_ca_cert},
            }
        ],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "c",
    }
    where.write_text(yaml.safe_dump(config))
    return where


def _token(kube: Kube, namespace: str, service_account: str) -> str:
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    )
    answer: Any = kube.core.create_namespaced_service_account_token(
        service_account, namespace, request
    )
    return str(answer.status.token)


def _operator_env(container: dict[str, Any], kubeconfig: Path) -> dict[str, str]:
    """The chart's env and nothing of ours: no admin kubeconfig, no test-tuned settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EMBER_", "KUBERNETES_")) and k != "KUBECONFIG"
    }
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    env["KUBECONFIG"] = str(kubeconfig)
    return env


@contextlib.contextmanager
def chart_operator(kube: Kube, tmp: Path, *values: str) -> Iterator[Callable[[], str]]:
    """The chart's RBAC applied and its operator running on it; yields a reader of its log.
    On exit: SIGTERM, a clean exit, and no 403 in the whole log."""
    system = f"rbac-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", system)
    docs = render(system, *values)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    rbac = [d for d in docs if d["kind"] != "Deployment"]
    (tmp / "rbac.yaml").write_text(yaml.safe_dump_all(rbac))
    kube.kubectl("apply", "--server-side", "-f", str(tmp / "rbac.yaml"))
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    kubeconfig = _kubeconfig(kube, _token(kube, system, pod["serviceAccountName"]), tmp / "kc")
    log = tmp / "operator.log"
    argv = [sys.executable, "-m", "ember_operator", *container["args"]]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=_operator_env(container, kubeconfig), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield log.read_text
    except BaseException as exc:  # a flow step timed out: the refused calls are the likely why
        exc.add_note("refused calls in the operator's log:\n" + "\n".join(_refused(log)[:20]))
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        kube.kubectl("delete", "-f", str(tmp / "rbac.yaml"), "--ignore-not-found", "--wait=false")
        kube.kubectl("delete", "namespace", system, "--wait=false")
    text = log.read_text()
    refused = _refused(log)
    assert not refused, "the chart's RBAC refused calls:\n" + "\n".join(refused[:20])
    assert code == 0, f"operator exited {code} on SIGTERM:\n{text[-4000:]}"
    assert "Traceback" not in text, text[-4000:]


def _refused(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if REFUSED.search(line)]


@pytest.fixture
def two_nodes(kube: Kube) -> Iterator[tuple[str, list[str]]]:
    """Two kwok nodes of one private site (a private taint keeps everyone else's pods off)."""
    site = f"rbac-{uuid.uuid4().hex[:6]}"
    names = [f"{site}-a", f"{site}-b"]
    manifests = []
    for name in names:
        m = node_manifest(name, site)
        m["spec"]["taints"].append(PRIVATE)
        m["status"].pop("nodeInfo", None)  # kubernetes>=37 rejects a partial NodeSystemInfo
        manifests.append(m)
    create_nodes(kube.api, manifests)
    wait_schedulable(kube.api, names)
    yield site, names
    for name in names:
        kube.core.delete_node(name)


def _running(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    pods = rest.items(kube.api, "pods", ns, label_selector=f"ember.dev/instance={name}")
    return [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


def _ready(kube: Kube, ns: str, name: str, replicas: int) -> bool:
    obj = rest.get(kube.api, "infd", ns, name) or {}
    st = obj.get("status") or {}
    return (
        st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("readyReplicas") == replicas
    )


def _hot(kube: Kube, node: str) -> bool:
    body: Any = kube.core.read_node(node)
    return any(t.key == HOT_TAINT_KEY for t in body.spec.taints or [])


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _flow(kube: Kube, ns: str, site: str) -> None:
    name = "rbac"
    infd = fleet_manifest(name, [site], replicas=2)
    infd["spec"]["placement"]["tolerations"] = [SIM_TOLERATION, {**PRIVATE, "operator": "Equal"}]
    infd["spec"]["thermal"] = {"criticalForSeconds": 1}
    rest.create(kube.api, "infd", ns, infd)
    # Created: children, the runtime's identity, status.
    wait_for("two ready replicas", lambda: _ready(kube, ns, name, 2), timeout=180)
    assert rest.get(kube.api, "pdbs", ns, name) is not None
    assert kube.core.read_namespaced_service_account("ember-runtime", ns)
    # Scaled to one: the PodDisruptionBudget goes.
    rest.merge_patch(kube.api, "infd", ns, name, {"spec": {"replicas": 1}})
    wait_for("the PDB deleted", lambda: rest.get(kube.api, "pdbs", ns, name) is None)
    wait_for("one ready replica", lambda: _ready(kube, ns, name, 1), timeout=120)
    # A child deleted by hand is re-created (a GET of its owner, then an apply that creates).
    rest.delete(kube.api, "services", ns, name)
    wait_for("the Service re-created", lambda: rest.get(kube.api, "services", ns, name))
    # A replica reports Critical: its node is tainted, the replica evicted, Events recorded; the
    # node agent's report of a cool node releases the taint.
    (pod,) = wait_for("one running replica", lambda: _running(kube, ns, name), timeout=120)
    node = pod["spec"]["nodeName"]
    critical = thermal_condition(ThermalReading("Critical", 95, 1, 8), _now())
    kube.core.patch_namespaced_pod_status(
        pod["metadata"]["name"], ns, {"status": {"conditions": [critical]}}
    )
    wait_for("the hot taint", lambda: _hot(kube, node), timeout=60)
    evicted = pod["metadata"]["name"]
    wait_for(
        "the replica evicted",
        lambda: evicted not in {p["metadata"]["name"] for p in _running(kube, ns, name)},
        timeout=60,
    )
    cool = thermal_condition(ThermalReading("Normal", 60), _now())
    kube.core.patch_node_status(node, {"status": {"conditions": [cool]}})
    wait_for("the hot taint released", lambda: not _hot(kube, node), timeout=60)
    reasons = {e["reason"] for e in rest.items(kube.api, "events", ns)}
    assert "ReplicaMovedOffHotNode" in reasons, reasons
    _rollout_flow(kube, ns, name, site)
    # Deleted: no finalizer to wait for, garbage collection takes the children.
    rest.delete(kube.api, "infd", ns, name)
    wait_for("the object gone", lambda: rest.get(kube.api, "infd", ns, name) is None, timeout=60)


def _rollout_flow(kube: Kube, ns: str, name: str, site: str) -> None:
    """spec.rollout: the site's own Deployment replaces the plain one (deleted with its
    ConfigMap), the site's Nodes are watched and annotated while it stages, and a new revision's
    ConfigMap replaces the old one's (deleted)."""
    wave = {"name": "all", "sites": [site], "bakeSeconds": 1}
    rest.merge_patch(kube.api, "infd", ns, name, {"spec": {"rollout": {"waves": [wave]}}})
    wait_for(
        "the site's Deployment", lambda: rest.get(kube.api, "deployments", ns, f"{name}-{site}")
    )
    wait_for("the plain one deleted", lambda: rest.get(kube.api, "deployments", ns, name) is None)

    def configmaps() -> list[str]:
        items = rest.items(kube.api, "configmaps", ns, label_selector=f"ember.dev/instance={name}")
        return sorted(c["metadata"]["name"] for c in items)

    (first,) = wait_for("one revision's ConfigMap", lambda: len(configmaps()) == 1 and configmaps())
    rest.merge_patch(kube.api, "infd", ns, name, {"spec": {"engine": {"contextLength": 1024}}})

    def rolled() -> bool:
        obj = rest.get(kube.api, "infd", ns, name) or {}
        rollout = (obj.get("status") or {}).get("rollout") or {}
        return rollout.get("phase") == "Complete" and rollout.get("stableRevision") not in (
            None,
            first.rsplit("-", 1)[-1],
        )

    wait_for("the new revision everywhere", rolled, timeout=120)
    wait_for("the old revision's ConfigMap deleted", lambda: first not in configmaps(), timeout=30)


@pytest.mark.usefixtures("crd")
def test_default_install_needs_nothing_the_chart_does_not_grant(
    kube: Kube, namespace: str, two_nodes: tuple[str, list[str]], tmp_path: Path
) -> None:
    with chart_operator(kube, tmp_path):
        _flow(kube, namespace, two_nodes[0])


@pytest.mark.usefixtures("crd")
def test_peering_replicas_on_a_namespace_list_need_nothing_more(
    kube: Kube, namespace: str, two_nodes: tuple[str, list[str]], tmp_path: Path
) -> None:
    values = ("operator.replicas=2", f"operator.watchNamespaces={{{namespace}}}")
    with chart_operator(kube, tmp_path, *values):
        _flow(kube, namespace, two_nodes[0])
