"""The operator against the real control plane (and the kwok fleet for pods that become Ready).

Each test runs the operator in-process with KopfRunner, watching only its fresh namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.cache import cache_label
from ember_runtime.contract.download import Observation, progress_message
from ember_runtime.contract.resource import SITE_LABEL
from ember_runtime.prewarm.errors import ChecksumMismatch

from tests.operator import rest
from tests.operator.conftest import running_operator
from tests.operator.specs import SHA, fleet_manifest, manifest
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

SITES = ["site-0", "site-1", "site-2"]
OURS = "app.kubernetes.io/managed-by=ember-operator"
CHILD_KINDS = {
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "PodDisruptionBudget": "pdbs",
}


@pytest.fixture(scope="module")
def nodes(fleet: Callable[..., list[str]]) -> list[str]:
    return fleet(6, sites=3)


def _node_sites(kube: Any) -> dict[str, str]:
    """Each node's `ember.dev/site` label ("" where it has none)."""
    listing = rest.request(kube.api, "GET", "/api/v1/nodes")
    return {
        n["metadata"]["name"]: n["metadata"]["labels"].get(SITE_LABEL, "") for n in listing["items"]
    }


def _infd(kube: Any, ns: str, name: str) -> dict[str, Any]:
    obj = rest.get(kube.api, "infd", ns, name)
    assert obj is not None, f"{ns}/{name} is gone"
    return obj


def _deployment(kube: Any, ns: str, name: str) -> dict[str, Any] | None:
    return rest.get(kube.api, "deployments", ns, name)


def _pod_template(dep: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = dep["spec"]["template"]
    return template


def _config_hash(kube: Any, ns: str, name: str) -> str | None:
    dep = _deployment(kube, ns, name)
    return _pod_template(dep)["metadata"]["annotations"]["ember.dev/config-hash"] if dep else None


def _ready(kube: Any, ns: str, name: str) -> bool:
    obj = _infd(kube, ns, name)
    st = obj.get("status") or {}
    return (
        rest.condition(obj, "Ready").get("status") == "True"
        and st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("readyReplicas") == obj["spec"]["replicas"]
    )


def _children(kube: Any, ns: str) -> dict[str, list[str]]:
    return {
        kind: sorted(
            o["metadata"]["name"] for o in rest.items(kube.api, plural, ns, label_selector=OURS)
        )
        for kind, plural in CHILD_KINDS.items()
    }


def test_apply_creates_owned_children(kube: Any, namespace: str, operator: Any) -> None:
    uid = rest.create(kube.api, "infd", namespace, manifest("alpha", replicas=2))["metadata"]["uid"]
    wait_for("children", lambda: all(_children(kube, namespace).values()))
    assert _children(kube, namespace) == {
        "Deployment": ["alpha"],
        "Service": ["alpha"],
        "ConfigMap": ["alpha-config"],
        "PodDisruptionBudget": ["alpha"],
    }
    dep = _deployment(kube, namespace, "alpha")
    assert dep is not None
    (ref,) = dep["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "InferenceDeployment",
        "alpha",
        uid,
        True,
    )
    pod = _pod_template(dep)["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "ember_runtime.prewarm", "prewarm"]
    runtime = pod["containers"][0]
    assert runtime["command"] == ["python", "-m", "ember_runtime.server"]
    assert runtime["securityContext"]["readOnlyRootFilesystem"] is True
    assert runtime["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    shm = next(v for v in pod["volumes"] if v["name"] == "prewarm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert runtime["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert _config_hash(kube, namespace, "alpha")
    assert "ember-operator" in {m["manager"] for m in dep["metadata"]["managedFields"]}
    selector = wait_for(
        "status.selector",
        lambda: (_infd(kube, namespace, "alpha").get("status") or {}).get("selector"),
    )
    assert selector == "app.kubernetes.io/name=ember,ember.dev/instance=alpha"
    # Nothing of Kopf's bookkeeping on the object: no finalizer (deleting it never waits for a
    # running operator), no last-handled copy of the spec, no progress annotations.
    meta = _infd(kube, namespace, "alpha")["metadata"]
    assert not meta.get("finalizers"), meta.get("finalizers")
    assert not [a for a in meta.get("annotations") or {} if a.startswith("ember.dev/")]


def test_the_operator_reads_its_settings_when_it_starts(
    kube: Any, namespace: str, crd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its settings come from the environment of this start, not of the module's import: an
    earlier operator in the same process (the suite runs many) must not pin them. CI failed on
    this: the runtime pods of a later test got no API server override and could not write
    their conditions."""
    import ember_operator.handlers  # noqa: F401 - imported first, as by earlier tests

    monkeypatch.setenv("EMBER_OPERATOR_RUNTIME_API_SERVER_HOST", "192.0.2.77")
    monkeypatch.setenv("EMBER_OPERATOR_RUNTIME_API_SERVER_PORT", "6443")
    with running_operator(namespace):
        rest.create(kube.api, "infd", namespace, manifest("settled"))
        deployment = wait_for("the Deployment", lambda: _deployment(kube, namespace, "settled"))
    runtime = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime"
    )
    env = {e["name"]: e.get("value") for e in runtime.get("env") or []}
    assert env["KUBERNETES_SERVICE_HOST"] == "192.0.2.77"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"


def test_spec_edit_rolls_a_new_replicaset(kube: Any, namespace: str, operator: Any) -> None:
    rest.create(kube.api, "infd", namespace, manifest("beta"))
    before = wait_for("deployment", lambda: _config_hash(kube, namespace, "beta"))
    rest.merge_patch(
        kube.api, "infd", namespace, "beta", {"spec": {"engine": {"contextLength": 4096}}}
    )
    wait_for("new config hash", lambda: _config_hash(kube, namespace, "beta") not in (before, None))

    def two_replicasets() -> list[dict[str, Any]] | None:
        found = rest.items(
            kube.api, "replicasets", namespace, label_selector="ember.dev/instance=beta"
        )
        return found if len(found) == 2 else None

    replicasets = wait_for("two replicasets", two_replicasets)
    assert len({r["metadata"]["labels"]["pod-template-hash"] for r in replicasets}) == 2
    cm = rest.get(kube.api, "configmaps", namespace, "beta-config")
    assert cm is not None and "contextLength: 4096" in cm["data"]["config.yaml"]


def test_deleted_and_hand_edited_children_are_repaired(
    kube: Any, namespace: str, operator: Any
) -> None:
    rest.create(kube.api, "infd", namespace, manifest("gamma"))
    first = wait_for("deployment", lambda: _deployment(kube, namespace, "gamma"))
    rest.delete(kube.api, "deployments", namespace, "gamma")

    def recreated() -> dict[str, Any] | None:
        dep = _deployment(kube, namespace, "gamma")
        return dep if dep and dep["metadata"]["uid"] != first["metadata"]["uid"] else None

    assert wait_for("re-created deployment", recreated)["spec"]["replicas"] == 1
    rest.merge_patch(kube.api, "deployments", namespace, "gamma", {"spec": {"replicas": 7}})
    wait_for(
        "replicas repaired",
        lambda: (_deployment(kube, namespace, "gamma") or {})["spec"]["replicas"] == 1,
    )
    rest.delete(kube.api, "services", namespace, "gamma")
    wait_for("service back", lambda: _children(kube, namespace)["Service"] == ["gamma"])


def test_a_refused_child_is_reported_and_retried_until_it_fits(
    kube: Any, namespace: str, operator: Any
) -> None:
    """A quota refuses the Deployment (403): the condition says so, and once the quota is lifted
    the retry (no new event on the object) creates it — no edit, no restart needed."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-deployments"},
        "spec": {"hard": {"count/deployments.apps": "0"}},
    }
    rest.request(kube.api, "POST", f"/api/v1/namespaces/{namespace}/resourcequotas", body=quota)
    rest.create(kube.api, "infd", namespace, manifest("quota"))

    def rejected() -> dict[str, Any] | None:
        degraded = rest.condition(_infd(kube, namespace, "quota"), "Degraded")
        return degraded if degraded.get("reason") == "ApplyRejected" else None

    assert "exceeded quota" in wait_for("rejected", rejected)["message"]
    assert _deployment(kube, namespace, "quota") is None
    path = f"/api/v1/namespaces/{namespace}/resourcequotas/no-deployments"
    rest.request(kube.api, "DELETE", path)
    wait_for("deployment after the quota went", lambda: _deployment(kube, namespace, "quota"))
    wait_for("not degraded", lambda: rejected() is None)


def test_deleting_needs_no_running_operator(kube: Any, namespace: str, crd: Any) -> None:
    """No finalizer: an object deleted after Ember is uninstalled goes at once."""
    with running_operator(namespace):
        rest.create(kube.api, "infd", namespace, manifest("orphan"))
        wait_for("deployment", lambda: _deployment(kube, namespace, "orphan"))
        wait_for("status", lambda: _infd(kube, namespace, "orphan").get("status") or {})
    rest.delete(kube.api, "infd", namespace, "orphan")
    wait_for("gone", lambda: rest.get(kube.api, "infd", namespace, "orphan") is None, timeout=15)


def test_delete_garbage_collects_children(kube: Any, namespace: str, operator: Any) -> None:
    rest.create(kube.api, "infd", namespace, manifest("delta", replicas=2))
    wait_for("children", lambda: all(_children(kube, namespace).values()))
    rest.delete(kube.api, "infd", namespace, "delta", propagationPolicy="Foreground")
    wait_for("children gone", lambda: not any(_children(kube, namespace).values()), timeout=180)
    # Foreground deletion: the GC removes the owner's finalizer just after its last child.
    wait_for("the infd gone", lambda: rest.get(kube.api, "infd", namespace, "delta") is None)


def test_restart_mid_way_makes_no_duplicates(kube: Any, namespace: str, crd: Any) -> None:
    names = [f"r{i}" for i in range(4)]
    with running_operator(namespace):
        for name in names:
            rest.create(kube.api, "infd", namespace, manifest(name))
        wait_for("some children", lambda: _children(kube, namespace)["Deployment"])
    with running_operator(namespace):

        def all_observed() -> bool:
            return all(
                (_infd(kube, namespace, n).get("status") or {}).get("observedGeneration") == 1
                for n in names
            )

        wait_for("all observed", all_observed)
    children = _children(kube, namespace)
    assert children["Deployment"] == names
    assert children["Service"] == names
    assert children["ConfigMap"] == [f"{n}-config" for n in names]
    assert len(rest.items(kube.api, "replicasets", namespace)) == len(names)


def test_scale_subresource_and_printer_columns(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    rest.create(kube.api, "infd", namespace, fleet_manifest("eps", SITES, replicas=1))
    wait_for("ready at 1", lambda: _ready(kube, namespace, "eps"), timeout=180)
    kube.kubectl("-n", namespace, "scale", "infd/eps", "--replicas=3")
    wait_for(
        "deployment at 3",
        lambda: (_deployment(kube, namespace, "eps") or {})["spec"]["replicas"] == 3,
    )
    wait_for("ready at 3", lambda: _ready(kube, namespace, "eps"), timeout=180)
    assert _children(kube, namespace)["PodDisruptionBudget"] == ["eps"]
    scale_path = f"{rest.path('infd', namespace, 'eps')}/scale"
    scale = json.loads(kube.kubectl("get", "--raw", scale_path))
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "app.kubernetes.io/name=ember,ember.dev/instance=eps"
    header, row = kube.kubectl("-n", namespace, "get", "infd").splitlines()[:2]
    columns = [
        *("NAME", "READY", "MODEL", "ENGINE", "ACCELERATOR", "STATUS", "TEMP", "BATCH"),
        *("ROLLOUT", "AGE"),
    ]
    assert header.split() == columns
    assert row.split()[:6] == ["eps", "3/3", "gemma-3-270m", "llamacpp", "cpu", "AllReplicasReady"]
    assert "eps" in kube.kubectl("-n", namespace, "get", "ember")  # the category
    kube.kubectl("-n", namespace, "scale", "infd/eps", "--replicas=1")
    wait_for("no PDB at 1", lambda: _children(kube, namespace)["PodDisruptionBudget"] == [])


def test_sites_spread_and_ready(kube: Any, namespace: str, operator: Any, nodes: list[str]) -> None:
    rest.create(kube.api, "infd", namespace, fleet_manifest("zeta", SITES, replicas=3))
    wait_for("ready", lambda: _ready(kube, namespace, "zeta"), timeout=180)
    pods = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=zeta")
    node_site = _node_sites(kube)
    assert sorted(node_site[p["spec"]["nodeName"]] for p in pods) == SITES
    obj = _infd(kube, namespace, "zeta")
    assert obj["status"]["readyReplicas"] == 3 and obj["status"]["ready"] == "3/3"
    assert rest.condition(obj, "Progressing")["status"] == "False"
    assert rest.condition(obj, "Degraded")["status"] == "False"
    rows = obj["status"]["replicaStatuses"]
    assert sorted(r["pod"] for r in rows) == sorted(p["metadata"]["name"] for p in pods)
    assert all(r["node"] in node_site and r["phase"] == "Running" for r in rows)


WATCHED = ["infd", "deployments", "services", "configmaps", "pdbs", "events"]


def test_steady_state_issues_zero_writes(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    for name, replicas in (("st-a", 1), ("st-b", 2)):
        rest.create(kube.api, "infd", namespace, fleet_manifest(name, SITES, replicas=replicas))
    wait_for(
        "ready",
        lambda: _ready(kube, namespace, "st-a") and _ready(kube, namespace, "st-b"),
        timeout=180,
    )
    writes = rest.count_writes(kube.api, namespace, WATCHED, seconds=10)
    assert writes == [], writes


def test_unservable_spec_becomes_a_condition_not_a_loop(
    kube: Any, namespace: str, operator: Any
) -> None:
    rest.create(kube.api, "infd", namespace, manifest("bad", prewarm={"sharedMemoryLimit": "1Mi"}))

    def degraded_object() -> dict[str, Any] | None:
        obj = _infd(kube, namespace, "bad")
        return obj if rest.condition(obj, "Degraded").get("status") == "True" else None

    obj = wait_for("degraded", degraded_object)
    degraded = rest.condition(obj, "Degraded")
    assert degraded["reason"] == "SharedMemoryTooSmall"
    assert "sharedMemoryLimit" in degraded["message"]
    assert rest.condition(obj, "Ready")["status"] == "False"
    assert obj["status"]["reason"] == "SharedMemoryTooSmall"
    assert _children(kube, namespace)["Deployment"] == []  # nothing that would crash-loop
    events = rest.items(kube.api, "events", namespace, field_selector="involvedObject.name=bad")
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["SharedMemoryTooSmall"]
    # No hot loop: nothing is rewritten and no further events are posted.
    writes = rest.count_writes(kube.api, namespace, WATCHED, seconds=5)
    assert writes == [], writes
    rest.merge_patch(
        kube.api, "infd", namespace, "bad", {"spec": {"prewarm": {"sharedMemoryLimit": "1Gi"}}}
    )
    # Fixed: the spec problem is gone. Degraded itself may now carry the pod's own state (this
    # test's pod has no image it can pull on the real node, nor a node when that is down).
    wait_for(
        "fixed",
        lambda: (
            rest.condition(_infd(kube, namespace, "bad"), "Degraded").get("reason")
            != "SharedMemoryTooSmall"
        ),
    )
    wait_for("deployment", lambda: _deployment(kube, namespace, "bad"))


def test_two_replicas_never_both_act(kube: Any, namespace: str, crd: Any, tmp_path: Path) -> None:
    """Two `python -m ember_operator` processes in one peering: one acts, the other pauses."""
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
    cmd = [
        sys.executable,
        "-m",
        "ember_operator",
        "-n",
        namespace,
        "--peering",
        "ember-test",
        "--metrics-port",
        "0",
        "--liveness-port",
        "0",
    ]
    logs = [tmp_path / f"op{i}.log" for i in range(2)]
    procs = []
    for log in logs:
        with log.open("w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        # Both up and in the peering. Which one pauses is Kopf's business (random priorities);
        # a replica that starts after its peer may stay in its initial pause without a log
        # line, so the log is no proxy for the outcome: what counts is that exactly one acts.
        wait_for(
            "both replicas started",
            lambda: all("Initial authentication has finished" in p.read_text() for p in logs),
            timeout=180,  # two cold Python+Kopf starts on a loaded 2-core machine
        )
        time.sleep(3)  # a keepalive round: each has seen the other's peering record
        rest.create(kube.api, "infd", namespace, manifest("peer"))
        wait_for("children", lambda: _children(kube, namespace)["Deployment"] == ["peer"])
        time.sleep(2)
        handled = [p.read_text().count(f"applied Deployment {namespace}/peer") for p in logs]
        assert sorted(handled) == [0, 1], handled
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(30) == 0  # SIGTERM is a clean exit


def test_init_container_failure_degrades_with_an_event(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    """A prewarm failure as the kubelet reports it (written to the pod's status subresource on a
    kwok node, which has no kubelet) surfaces as Degraded with the prewarm's reason, plus one
    Warning Event."""
    rest.create(kube.api, "infd", namespace, fleet_manifest("eta", SITES))
    wait_for("ready", lambda: _ready(kube, namespace, "eta"), timeout=180)
    (pod,) = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=eta")
    # The line the prewarm container writes, from its own writer (kwok runs no container).
    message = ChecksumMismatch("gemma.gguf", SHA, "1" * 64).termination_message()
    rest.fail_prewarm(kube.api, namespace, pod["metadata"]["name"], message)

    def warned() -> list[dict[str, Any]]:
        events = rest.items(kube.api, "events", namespace, field_selector="involvedObject.name=eta")
        return [e for e in events if e["reason"] == "ChecksumMismatch"]

    (event,) = wait_for("warning event", warned, timeout=30)
    assert event["type"] == "Warning"
    assert f"gemma.gguf expected {SHA[:12]}… got 111111111111…" in event["message"]
    # The Event is posted only when Degraded turns True with a new reason, and carries its
    # message ("pod <name>: ..."), so it proves the condition was set from this pod.
    assert pod["metadata"]["name"] in event["message"]


def _report_prewarm(kube: Any, namespace: str, pod: str, message: str | None) -> None:
    """Set the pod's prewarm status as the kubelet would (see `_init_status`)."""
    rest.request(
        kube.api,
        "PATCH",
        f"{rest.path('pods', namespace, pod)}/status",
        body={"status": {"initContainerStatuses": [_init_status(message)]}},
        content_type="application/strategic-merge-patch+json",
    )


def _init_status(message: str | None) -> dict[str, Any]:
    """prewarm as the kubelet reports it: back-off after a ModelDownloading exit, or (None)
    completed after one (its lastState keeps the old exit)."""
    line = reasons.termination_message(reasons.MODEL_DOWNLOADING, message or "n: 1 of 2 GB")
    state = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    if message is not None:
        state = {"waiting": {"reason": "CrashLoopBackOff"}}
    return {
        "name": "prewarm",
        "image": "x",
        "imageID": "",
        "ready": message is None,
        "restartCount": 1,
        "state": state,
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": line}},
    }


def test_http_source_prefers_cached_nodes_and_shows_each_nodes_download(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    """An http-sourced object on the kwok fleet: the real Deployment carries a preferred
    nodeAffinity term for the cache label, and the real scheduler puts the replica on the one
    node labelled as holding the model (as its agent would label it; the agent's own writes are
    tests/nodeagent/test_site_cluster.py's). Then both replicas' prewarms report
    ModelDownloading (the line prewarm itself writes, set on the pod status as the kubelet
    would): Degraded lists each node with its bytes and ETA, `kubectl get infd` shows
    ModelDownloading, and one Event goes out when the wait starts, not per report."""
    sha = uuid.uuid4().hex * 2  # this test's own digest: its label is on no other node
    # A node the spec's sites allow. The fleet is reused across the suite: an earlier test may
    # have made kwok-4 with 5 sites (site-4), which `placement.sites` rules out.
    node_site = _node_sites(kube)
    holder = next(n for n in reversed(nodes) if node_site[n] in SITES)
    label = cache_label(sha)
    body = fleet_manifest("dl", SITES, replicas=1)
    body["spec"]["model"]["files"][0]["sha256"] = sha
    body["spec"]["model"]["source"] = {"http": {"urls": {"gemma.gguf": "https://m.example/g"}}}
    rest.request(
        kube.api,
        "PATCH",
        f"/api/v1/nodes/{holder}",
        body={"metadata": {"labels": {label: "true"}}},
        content_type="application/merge-patch+json",
    )
    try:
        rest.create(kube.api, "infd", namespace, body)
        wait_for("ready", lambda: _ready(kube, namespace, "dl"), timeout=180)
        dep = _deployment(kube, namespace, "dl")
        assert dep is not None
        preferred = _pod_template(dep)["spec"]["affinity"]["nodeAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        expression = {"key": label, "operator": "In", "values": ["true"]}
        assert preferred == [{"weight": 100, "preference": {"matchExpressions": [expression]}}]
        (pod,) = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=dl")
        assert pod["spec"]["nodeName"] == holder
    finally:
        rest.request(
            kube.api,
            "PATCH",
            f"/api/v1/nodes/{holder}",
            body={"metadata": {"labels": {label: None}}},
            content_type="application/merge-patch+json",
        )
    kube.kubectl("-n", namespace, "scale", "infd/dl", "--replicas=2")
    wait_for("ready at 2", lambda: _ready(kube, namespace, "dl"), timeout=180)
    pods = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=dl")
    reports = {}
    for i, p in enumerate(sorted(pods, key=lambda p: p["spec"]["nodeName"])):
        node = p["spec"]["nodeName"]
        done = (i + 1) * 600_000_000
        detail = progress_message(node, Observation(0.0, 0), Observation(60.0, done), 3_400_000_000)
        reports[p["metadata"]["name"]] = detail
        _report_prewarm(kube, namespace, p["metadata"]["name"], detail)
    both = "2 nodes wait for the model: " + "; ".join(sorted(reports.values()))
    assert "0.6 of 3.4 GB in the node cache, ETA 4m40s" in both
    wait_for(
        "both nodes listed",
        lambda: rest.condition(_infd(kube, namespace, "dl"), "Degraded").get("message") == both,
        timeout=30,
    )
    obj = _infd(kube, namespace, "dl")
    assert obj["status"]["reason"] == "ModelDownloading"
    row = kube.kubectl("-n", namespace, "get", "infd", "dl").splitlines()[1]
    assert row.split()[5] == "ModelDownloading"

    def downloading() -> list[dict[str, Any]]:
        events = rest.items(kube.api, "events", namespace, field_selector="involvedObject.name=dl")
        return [e for e in events if e["reason"] == "ModelDownloading"]

    wait_for(
        "the first report's Event",
        lambda: [e for e in downloading() if e["message"] == both],
        timeout=30,
    )
    # (The two patches may reach the operator apart: then "1 node waits" came first.)
    before = len(downloading())
    # One node's prewarm completes: the message (and one more Event) names only the other.
    first = min(reports, key=lambda name: reports[name])
    _report_prewarm(kube, namespace, first, None)
    (rest_node,) = [d for name, d in reports.items() if name != first]
    one = f"1 node waits for the model: {rest_node}"
    wait_for(
        "one node left",
        lambda: rest.condition(_infd(kube, namespace, "dl"), "Degraded").get("message") == one,
        timeout=30,
    )
    # The condition carries the live figures; the Event was for the wait starting (one per
    # wait, not one per report: the agent reports every 30 s), so nothing more is posted.
    time.sleep(3)  # refreshes in the meantime (pod events, resyncs) post nothing either
    events = downloading()
    assert len(events) == before, [e["message"] for e in events]
