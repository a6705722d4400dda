"""Site-by-site rollouts on the real control plane: two sites of kwok nodes, the operator
in-process, the real scheduler and Deployment controller. kwok runs no container, so what a
node would report is written the way its kubelet or agent writes it: a prewarm failure on the
pod's status, a cache label on the Node (the node agent's own writes are tested in
tests/nodeagent)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from ember_runtime.contract.cache import cache_label
from ember_runtime.contract.rollout import stage_annotation
from ember_runtime.prewarm.errors import ChecksumMismatch

from tests.fleet.health import check_object
from tests.operator import rest
from tests.operator.specs import SHA, fleet_manifest
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

SITES = ["site-0", "site-1"]
MERGE = "application/merge-patch+json"


@pytest.fixture(scope="module")
def nodes(fleet: Callable[..., list[str]]) -> list[str]:
    return fleet(6, sites=3)


def _rolling(name: str, bake: int = 4, **rollout: Any) -> dict[str, Any]:
    body = fleet_manifest(name, SITES, replicas=2)
    body["spec"]["rollout"] = {
        "waves": [{"name": "canary", "sites": ["site-0"], "bakeSeconds": bake}],
        "gate": {"readyTimeoutSeconds": 60},
        **rollout,
    }
    return body


def _infd(kube: Any, ns: str, name: str) -> dict[str, Any]:
    obj = rest.get(kube.api, "infd", ns, name)
    assert obj is not None
    return obj


def _rollout(kube: Any, ns: str, name: str) -> dict[str, Any]:
    return dict((_infd(kube, ns, name).get("status") or {}).get("rollout") or {})


def _site_revisions(kube: Any, ns: str, name: str) -> dict[str, str]:
    """Each site Deployment's pod-template revision."""
    out = {}
    for site in SITES:
        dep = rest.get(kube.api, "deployments", ns, f"{name}-{site}")
        if dep is not None:
            out[site] = dep["spec"]["template"]["metadata"]["labels"]["ember.dev/revision"]
    return out


def _complete(kube: Any, ns: str, name: str) -> bool:
    obj = _infd(kube, ns, name)
    st = obj.get("status") or {}
    ready = rest.condition(obj, "Ready").get("status") == "True"
    return (
        ready
        and st.get("observedGeneration") == obj["metadata"]["generation"]
        and (st.get("rollout") or {}).get("phase") == "Complete"
    )


def _edit(kube: Any, ns: str, name: str, spec: dict[str, Any]) -> None:
    rest.merge_patch(kube.api, "infd", ns, name, {"spec": spec})


def _reasons(kube: Any, ns: str, name: str) -> list[str]:
    selector = f"involvedObject.name={name},involvedObject.kind=InferenceDeployment"
    events = rest.items(kube.api, "events", ns, field_selector=selector)
    return [e["reason"] for e in sorted(events, key=lambda e: e["metadata"]["creationTimestamp"])]


def _start(kube: Any, ns: str, body: dict[str, Any]) -> str:
    name = body["metadata"]["name"]
    rest.create(kube.api, "infd", ns, body)
    wait_for("first version everywhere", lambda: _complete(kube, ns, name), timeout=180)
    revisions = _site_revisions(kube, ns, name)
    first = _rollout(kube, ns, name)["stableRevision"]
    assert revisions == {"site-0": first, "site-1": first}
    return str(first)


def test_a_two_site_rollout_passes_wave_by_wave(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    first = _start(kube, namespace, _rolling("roll", bake=6))
    pods = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=roll")
    assert sorted(p["metadata"]["labels"]["ember.dev/site-slice"] for p in pods) == SITES
    _edit(kube, namespace, "roll", {"engine": {"contextLength": 1024}})
    second = wait_for(
        "the canary on the new revision",
        lambda: (r := _site_revisions(kube, namespace, "roll"))["site-0"] != first and r["site-0"],
        timeout=60,
    )
    assert _site_revisions(kube, namespace, "roll")["site-1"] == first
    # The operator writes status after it applies the sites: a moment after the canary moved.
    status = wait_for(
        "the new revision in status",
        lambda: (s := _rollout(kube, namespace, "roll"))["updateRevision"] == second and s,
        timeout=30,
    )
    assert status["currentWave"] == "canary"
    row = kube.kubectl("-n", namespace, "get", "infd", "roll").splitlines()[1]
    assert "canary" in row, row  # the ROLLOUT column
    assert check_object(_infd(kube, namespace, "roll")) == ("InProgress", "Progressing")
    # site-1 waits for the canary's bake (6 s after its replica is Ready)
    time.sleep(3)
    assert _site_revisions(kube, namespace, "roll")["site-1"] == first
    wait_for("rolled out", lambda: _complete(kube, namespace, "roll"), timeout=120)
    assert _site_revisions(kube, namespace, "roll") == {"site-0": second, "site-1": second}
    status = _rollout(kube, namespace, "roll")
    assert status["stableRevision"] == second and "currentWave" not in status
    assert [w["phase"] for w in status["waves"]] == ["Passed", "Passed"]
    reasons = _reasons(kube, namespace, "roll")
    for expected in ("RolloutStarted", "WaveStarted", "WavePassed", "RolloutComplete"):
        assert expected in reasons, reasons
    assert reasons.count("WaveStarted") == 2 and reasons.count("WavePassed") == 2, reasons
    obj = _infd(kube, namespace, "roll")
    assert rest.condition(obj, "Reconciling")["status"] == "False"
    assert rest.condition(obj, "Stalled")["status"] == "False"
    # What fleet engines read of the object as the operator left it: kstatus and Argo CD.
    assert check_object(obj) == ("Current", "Healthy")
    nodes_ = rest.request(kube.api, "GET", "/api/v1/nodes")["items"]
    key = stage_annotation(namespace, "roll")[0]
    assert not [n for n in nodes_ if key in (n["metadata"].get("annotations") or {})]


def test_a_version_that_fails_on_the_canary_is_rolled_back_there_alone(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    first = _start(kube, namespace, _rolling("bad", bake=30))
    site1 = rest.get(kube.api, "deployments", namespace, "bad-site-1")
    assert site1 is not None
    _edit(kube, namespace, "bad", {"engine": {"contextLength": 1024}})

    def canary_pod() -> str | None:
        pods = rest.items(
            kube.api,
            "pods",
            namespace,
            label_selector="ember.dev/instance=bad,ember.dev/site-slice=site-0",
        )
        new = [p for p in pods if p["metadata"]["labels"]["ember.dev/revision"] != first]
        return new[0]["metadata"]["name"] if new else None

    pod = wait_for("a canary pod on the new version", canary_pod, timeout=60)
    line = ChecksumMismatch("gemma.gguf", SHA, "1" * 64).termination_message()
    rest.fail_prewarm(kube.api, namespace, pod, line, restarts=2)
    wait_for(
        "rolled back", lambda: _rollout(kube, namespace, "bad").get("phase") == "RolledBack", 60
    )
    wait_for(
        "the canary back on the first version",
        lambda: _site_revisions(kube, namespace, "bad") == {"site-0": first, "site-1": first},
        timeout=30,
    )
    after = rest.get(kube.api, "deployments", namespace, "bad-site-1")
    assert after is not None
    assert after["metadata"]["generation"] == site1["metadata"]["generation"], "site-1 untouched"
    status = _rollout(kube, namespace, "bad")
    canary = next(s for s in status["sites"] if s["name"] == "site-0")
    assert (canary["phase"], canary["reason"]) == ("Failed", "ChecksumMismatch")
    obj = _infd(kube, namespace, "bad")
    assert rest.condition(obj, "Degraded")["reason"] == "RolledBack"
    assert rest.condition(obj, "Stalled")["status"] == "True"
    assert check_object(obj) == ("Failed", "Degraded")
    assert "RolledBack" in _reasons(kube, namespace, "bad")
    wait_for(
        "Ready again on the first version",
        lambda: rest.condition(_infd(kube, namespace, "bad"), "Ready").get("status") == "True",
        timeout=120,
    )


def test_pause_holds_and_resume_goes_on(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    first = _start(kube, namespace, _rolling("hold", bake=3))
    _edit(kube, namespace, "hold", {"engine": {"contextLength": 1024}, "rollout": {"paused": True}})
    wait_for("paused", lambda: _rollout(kube, namespace, "hold").get("phase") == "Paused", 30)
    time.sleep(6)
    assert _site_revisions(kube, namespace, "hold") == {"site-0": first, "site-1": first}
    assert "Paused" in kube.kubectl("-n", namespace, "get", "infd", "hold")
    assert check_object(_infd(kube, namespace, "hold")) == ("InProgress", "Suspended")
    kube.kubectl(
        "-n",
        namespace,
        "patch",
        "infd",
        "hold",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"rollout": {"paused": False}}}),
    )
    wait_for("rolled out", lambda: _complete(kube, namespace, "hold"), timeout=120)
    assert first not in _site_revisions(kube, namespace, "hold").values()


def test_a_site_changes_only_once_the_new_files_are_on_it(
    kube: Any, namespace: str, operator: Any, nodes: list[str]
) -> None:
    """An http source: the operator asks the site's nodes to stage the new digest and waits for
    a node agent's cache label before the canary's pods change (the test writes the label as
    the agent would)."""
    body = _rolling("stg", bake=2)
    body["spec"]["model"]["source"] = {"http": {"urls": {"gemma.gguf": "https://m.example/g"}}}
    first = _start(kube, namespace, body)
    sha = uuid.uuid4().hex * 2
    files = [{**body["spec"]["model"]["files"][0], "sha256": sha}]
    _edit(kube, namespace, "stg", {"model": {"files": files}})
    key, value = stage_annotation(namespace, "stg")
    site0 = [
        n["metadata"]["name"]
        for n in rest.request(kube.api, "GET", "/api/v1/nodes")["items"]
        if (n["metadata"].get("labels") or {}).get("ember.dev/site") == "site-0"
    ]

    def asked() -> bool:
        for node in site0:
            got = rest.request(kube.api, "GET", f"/api/v1/nodes/{node}")
            if (got["metadata"].get("annotations") or {}).get(key) != value:
                return False
        return True

    wait_for("the stage request on site-0's nodes", asked, timeout=30)
    time.sleep(3)
    assert _site_revisions(kube, namespace, "stg")["site-0"] == first, "changed before staged"
    assert _rollout(kube, namespace, "stg")["sites"][0]["phase"] == "Staging"
    label = cache_label(sha)
    try:
        rest.request(
            kube.api,
            "PATCH",
            f"/api/v1/nodes/{site0[0]}",
            body={"metadata": {"labels": {label: "true"}}},
            content_type=MERGE,
        )
        wait_for(
            "the canary changes once staged",
            lambda: _site_revisions(kube, namespace, "stg")["site-0"] != first,
            timeout=30,
        )
    finally:
        for node in site0:
            rest.request(
                kube.api,
                "PATCH",
                f"/api/v1/nodes/{node}",
                body={"metadata": {"labels": {label: None}}},
                content_type=MERGE,
            )
        rest.delete(kube.api, "infd", namespace, "stg")
    wait_for(
        "stage requests removed with the object",
        lambda: (
            not any(
                key
                in (
                    rest.request(kube.api, "GET", f"/api/v1/nodes/{n}")["metadata"].get(
                        "annotations"
                    )
                    or {}
                )
                for n in site0
            )
        ),
        timeout=30,
    )
