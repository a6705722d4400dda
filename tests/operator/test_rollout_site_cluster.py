"""A rollout against a real node agent: the operator in-process, one site whose node kwok keeps
Ready and whose real agent process (the chart's RBAC and policies, a token bound to a pod on its
node) fetches from a counting origin. A version with a wrong digest fails its stage at the site
without touching a pod; a version that stages but fails on the site rolls back to the previous
one, whose file the agent kept while its cache was over budget: the origin sends it once, ever."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.cache import cache_label
from ember_runtime.prewarm.errors import ChecksumMismatch

from tests.cluster.fleet import create_nodes, node_manifest, wait_schedulable
from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import TRUSTED_SITE_LABEL, SiteWorld
from tests.operator import rest
from tests.operator.conftest import running_operator
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SIZE = 300_000
V1, V3, WRONG = os.urandom(SIZE), os.urandom(SIZE), os.urandom(SIZE)
SHA1, SHA3 = hashlib.sha256(V1).hexdigest(), hashlib.sha256(V3).hexdigest()
SHA2 = hashlib.sha256(b"not what the origin sends").hexdigest()
TAINT = {"key": "ember.dev/rollout-site-test", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path, crd: Any) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        # A kwok node (kwok keeps it Ready: the operator reads a site's reachability from it,
        # and runs the replicas scheduled there) of the world's site, with the label the agent
        # trusts, and a private taint that keeps other tests' pods off.
        node = f"{world.site}-n0"
        body = node_manifest(node, world.site, accelerator="cpu")
        body["metadata"]["labels"][TRUSTED_SITE_LABEL] = world.site
        body["spec"]["taints"] = [TAINT]
        create_nodes(kube.api, [body])
        world.nodes.append(node)
        world.map_sites({node: world.site})
        world.want(None)  # the pod the agent's token is bound to
        wait_schedulable(kube.api, [node])
        yield world


def _infd(name: str, site: str, url: str, sha: str) -> dict[str, Any]:
    toleration = {**TAINT, "operator": "Equal"}
    return {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "model": _model(url, sha),
            "placement": {"sites": [site], "tolerations": [toleration]},
            "resources": {
                "requests": {"cpu": "100m", "memory": "256Mi"},
                "limits": {"memory": "256Mi"},
            },
            "rollout": {
                "waves": [{"name": "canary", "sites": [site], "bakeSeconds": 30}],
                "gate": {"readyTimeoutSeconds": 25},
            },
        },
    }


def _model(url: str, sha: str) -> dict[str, Any]:
    return {
        "name": "m",
        "source": {"http": {"urls": {"m.gguf": url}}},
        "files": [{"path": "m.gguf", "sha256": sha, "sizeBytes": SIZE}],
    }


def _rollout(kube: Kube, ns: str) -> dict[str, Any]:
    obj = rest.get(kube.api, "infd", ns, "roll") or {}
    return dict((obj.get("status") or {}).get("rollout") or {})


def _revision(kube: Kube, ns: str, site: str) -> str:
    dep = rest.get(kube.api, "deployments", ns, f"roll-{site}") or {}
    return str(dep["spec"]["template"]["metadata"]["labels"]["ember.dev/revision"])


def _fail_new_pod(kube: Kube, ns: str, first: str) -> None:
    """The new version's prewarm fails on the site, as its kubelet would report it."""

    def new_pod() -> str | None:
        pods = rest.items(kube.api, "pods", ns, label_selector="ember.dev/instance=roll")
        fresh = [p for p in pods if p["metadata"]["labels"]["ember.dev/revision"] != first]
        return fresh[0]["metadata"]["name"] if fresh else None

    pod = wait_for("the new version's pod", new_pod, timeout=60)
    line = ChecksumMismatch("m.gguf", SHA3, "0" * 64).termination_message()
    rest.fail_prewarm(kube.api, ns, pod, line, restarts=1)


def test_a_bad_version_rolls_back_from_the_site_cache_with_no_wan_fetch(
    kube: Kube, namespace: str, world: SiteWorld
) -> None:
    files = {"v1.gguf": V1, "v2.gguf": WRONG, "v3.gguf": V3}
    with serve(files) as (base, origin), running_operator(namespace):
        budget = ["--cache_max_bytes", str(SIZE + SIZE // 2), "--evict_interval_seconds=1"]
        world.start(str(kube.api.configuration.host), sharing=False, extra=budget)
        (agent,) = world.agents
        rest.create(kube.api, "infd", namespace, _infd("roll", world.site, f"{base}/v1.gguf", SHA1))
        wait_for("v1 everywhere", lambda: _rollout(kube, namespace).get("phase") == "Complete", 120)
        first = _revision(kube, namespace, world.site)
        wait_for(
            "v1 in the agent's cache", lambda: agent.cache.has(SHA1, SIZE), 60, on_fail=world.logs
        )

        # A wrong digest: the site's agent stages it, the bytes do not match, the site fails
        # its stage and its pod never changes.
        model2 = _model(f"{base}/v2.gguf", SHA2)
        rest.merge_patch(kube.api, "infd", namespace, "roll", {"spec": {"model": model2}})
        wait_for("rolled back", lambda: _rollout(kube, namespace).get("phase") == "RolledBack", 90)
        (site,) = _rollout(kube, namespace)["sites"]
        assert (site["phase"], site["reason"]) == ("Failed", "StageFailed")
        assert _revision(kube, namespace, world.site) == first
        assert origin.paths.count("/v2.gguf") >= 1, world.logs()
        second = _rollout(kube, namespace)["updateRevision"]

        # A good digest that fails on the site once its pod changed: back to v1 from the cache.
        model3 = _model(f"{base}/v3.gguf", SHA3)
        rest.merge_patch(kube.api, "infd", namespace, "roll", {"spec": {"model": model3}})
        wait_for("v3 staged", lambda: agent.cache.has(SHA3, SIZE), 60, on_fail=world.logs)
        node: Any = kube.core.read_node(world.nodes[0])
        assert (node.metadata.labels or {}).get(cache_label(SHA3)) == "true"
        _fail_new_pod(kube, namespace, first)

        def rolled_back_from_v3() -> bool:
            rollout = _rollout(kube, namespace)
            moved = rollout.get("updateRevision") not in (None, second)
            back = _revision(kube, namespace, world.site) == first
            return moved and rollout.get("phase") == "RolledBack" and back

        wait_for("rolled back from v3", rolled_back_from_v3, 60)
        (site,) = _rollout(kube, namespace)["sites"]
        assert (site["phase"], site["reason"]) == ("Failed", "ChecksumMismatch")
        # Over budget (v1 + v3 > 1.5 files) the whole time v3 ran; v1, in use by no pod then,
        # was kept for the rollback: never evicted, never fetched again.
        assert agent.cache.has(SHA1, SIZE), world.logs()
        assert origin.paths.count("/v1.gguf") == 1, origin.paths
