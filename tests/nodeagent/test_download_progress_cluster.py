"""A waiting replica's download progress, live (issue 34): the real node agent process writes
its pod's `ember.dev/ModelDownload` condition within 10 s of the pod starting to wait and then
every 30 s, on the real API server, under the chart's RBAC and ValidatingAdmissionPolicy, which
let its token write that condition and nothing else, on its own node's pods only.

The nodes have no kubelet (SiteWorld): nothing else writes these pods' status, so every change
seen is the agent's. The origin is paced by the agent's maxBandwidth so that the download
outlasts the test's look (8 MB at 20 kB/s, and the bucket's first burst).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.cache import MODEL_DOWNLOAD_CONDITION

from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import SiteWorld
from tests.support.waiting import poll
from tests.thermal.kube_support import chart_objects, kubectl_apply

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

DATA = os.urandom(8_000_000)
SHA = hashlib.sha256(DATA).hexdigest()
SMP = {"Content-Type": "application/strategic-merge-patch+json"}


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    world = SiteWorld(kube, namespace, tmp_path)
    policy = chart_objects("nodeagent-progress-admission.yaml", namespace=namespace)
    try:
        world.install()
        kubectl_apply(kube, policy, tmp_path)
        yield world
    finally:
        world.close()
        for o in policy:
            kube.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found")


def _condition(kube: Kube, namespace: str, pod: str) -> dict[str, Any] | None:
    body: Any = kube.core.read_namespaced_pod(pod, namespace)
    for c in body.status.conditions or []:
        if c.type == MODEL_DOWNLOAD_CONDITION:
            return {"status": c.status, "reason": c.reason, "message": c.message}
    return None


def test_progress_is_on_the_pod_within_10s_then_every_30s(
    world: SiteWorld, kube: Kube, namespace: str
) -> None:
    (node,) = world.add_nodes(["10.9.0.1"])
    with serve({"m.gguf": DATA}) as (base, _):
        world.want([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": len(DATA)}])
        (pod,) = world.pods
        waiting_since = time.monotonic()  # the pod exists: from now on it waits for its model
        world.start(
            str(kube.api.configuration.host),
            extra=["--origin_max_bytes_per_second=20000"],
            sharing=False,
        )
        seen: list[tuple[float, str]] = []  # (seconds since the pod started waiting, message)
        while time.monotonic() - waiting_since < 75:
            cond = _condition(kube, namespace, pod)
            if cond is not None and (not seen or cond["message"] != seen[-1][1]):
                assert cond["status"] == "True" and cond["reason"] == "ModelDownloading", cond
                seen.append((time.monotonic() - waiting_since, str(cond["message"])))
            time.sleep(0.25)
    print(seen)
    assert len(seen) >= 3, f"{seen}\n{world.logs()}"
    assert seen[0][0] <= 10, seen  # the agent's start (a Python process) included
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(seen)]
    assert all(28 <= g <= 34 for g in gaps), (gaps, seen)
    assert all(m.startswith(f"{node}: ") and " of 8.0 MB in the node cache" in m for _, m in seen)
    done = [float(m.split(": ")[1].split(" of ")[0]) for _, m in seen]
    assert done == sorted(done) and done[-1] > done[0], seen  # the bytes grow between reports
    assert "MB/s" in seen[-1][1] or "kB/s" in seen[-1][1], seen  # a rate, and so an ETA


def test_the_agent_may_write_only_this_condition_on_its_own_nodes_pods(
    world: SiteWorld, kube: Kube, namespace: str
) -> None:
    own, other = world.add_nodes(["10.9.0.2", "10.9.0.3"])
    world.want(None)
    own_pod = next(p for p in world.pods if p.startswith(f"{own}-"))
    other_pod = next(p for p in world.pods if p.startswith(f"{other}-"))
    sa = world._token(own)
    cond = {"type": MODEL_DOWNLOAD_CONDITION, "status": "True", "reason": "ModelDownloading"}
    with httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}", **SMP},
        timeout=10,
    ) as http:

        def patch(pod: str, body: dict[str, Any]) -> httpx.Response:
            return http.patch(f"/api/v1/namespaces/{namespace}/pods/{pod}/status", json=body)

        # The API server takes a second or so to start enforcing a new policy.
        theirs = poll(
            lambda: patch(other_pod, {"status": {"conditions": [{**cond, "message": "theirs"}]}}),
            30,
            0.5,
            until=lambda resp: resp.status_code != 200,
        )
        assert theirs.status_code == 403, theirs.text
        mine = patch(own_pod, {"status": {"conditions": [{**cond, "message": "mine"}]}})
        assert mine.status_code == 200, mine.text
        assert "only the status of pods on its own node" in theirs.text
        ready = {"type": "Ready", "status": "True"}
        other_cond = patch(own_pod, {"status": {"conditions": [ready]}})
        assert other_cond.status_code == 403, other_cond.text
        assert "only a pod's ember.dev/ModelDownload condition" in other_cond.text
        label = patch(own_pod, {"metadata": {"labels": {"app": "hijacked"}}})
        assert label.status_code == 403, label.text
        phase = patch(own_pod, {"status": {"phase": "Failed"}})
        assert phase.status_code == 403, phase.text
    assert (_condition(kube, namespace, own_pod) or {}).get("message") == "mine"
