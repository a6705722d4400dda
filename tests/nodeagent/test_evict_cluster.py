"""Cache budget (issue 34): least-recently-used eviction that never evicts a model in use.

The pods that make a digest "in use" are real pods on the real API server, bound to a node
name of this test's own (they never run: nothing serves that node), listed by the agent's own
reader with a token of a ServiceAccount that may only list pods. What each pod's files are comes,
in the agent, from the InferenceDeployment its pod watch read (`Fetcher.fetch_of`); here
`_fetch_of` reads it from a test annotation instead (test_fetch_trust_cluster.py covers that
resolution). The cache is a real directory filled past its budget.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.config import ModelFetch
from ember_runtime.kube import ApiError, Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.evict import Evictor, pods_on_node
from ember_runtime.nodeagent.fetcher import Unresolved
from ember_runtime.nodeagent.views import DigestViews
from kubernetes import client

from tests.conftest import Kube
from tests.nodeagent.blobs import aged_blob
from tests.operator import rest
from tests.thermal.kube_support import token_dir

pytestmark = pytest.mark.cluster

MB = 1_000_000


def _blob(cache: ContentCache, size: int, age_s: float) -> str:
    return aged_blob(cache, size, age_s)[0]


FILES = "test.ember.dev/files"  # what this test's pods name (the agent: their spec's files)


def _fetch_of(pod: dict[str, Any]) -> ModelFetch | None:
    raw = (pod["metadata"].get("annotations") or {}).get(FILES)
    return None if raw is None else ModelFetch.model_validate_json(raw)


def _unresolved(pod: dict[str, Any]) -> ModelFetch | None:
    raise Unresolved(pod["metadata"]["name"])


def _pod(name: str, node: str, digests: list[str]) -> dict[str, Any]:
    files = [{"url": f"https://origin.example/{d}", "sha256": d, "sizeBytes": 1} for d in digests]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {FILES: json.dumps({"files": files})},
        },
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "none"}]},
    }


@pytest.fixture
def reader(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[KubeClient]:
    """The agent's reader with a token that may list pods and nothing else."""
    name = f"{namespace}-evict"
    rbac = client.RbacAuthorizationV1Api(kube.api)
    kube.core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="agent"))
    )
    rule = client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])
    rbac.create_cluster_role(
        client.V1ClusterRole(metadata=client.V1ObjectMeta(name=name), rules=[rule])
    )
    subject = client.RbacV1Subject(kind="ServiceAccount", name="agent", namespace=namespace)
    role_ref = client.V1RoleRef(
        api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name), role_ref=role_ref, subjects=[subject]
        )
    )
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    answer: Any = kube.core.create_namespaced_service_account_token("agent", namespace, request)
    sa = token_dir(kube, str(answer.status.token), tmp_path / "sa")
    endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")
    yield KubeClient(endpoint)
    rbac.delete_cluster_role_binding(name)
    rbac.delete_cluster_role(name)


def test_over_budget_evicts_the_least_recently_used_unused_models_only(
    kube: Kube, namespace: str, tmp_path: Path, reader: KubeClient
) -> None:
    node = f"{namespace}-node"  # no such node: the pods stay Pending, bound to it
    cache = ContentCache(tmp_path / "cache")
    # Oldest first: `old_in_use` is the oldest of all, and a pod on the node names it.
    old_in_use = _blob(cache, 3 * MB, age_s=5000)
    oldest_unused = _blob(cache, 2 * MB, age_s=4000)
    older_unused = _blob(cache, 2 * MB, age_s=3000)
    recent_unused = _blob(cache, 2 * MB, age_s=100)
    new_in_use = _blob(cache, 1 * MB, age_s=10)
    elsewhere = _blob(cache, 1 * MB, age_s=6000)  # named only by a pod on another node
    rest.create(kube.api, "pods", namespace, _pod("a", node, [old_in_use]))
    rest.create(kube.api, "pods", namespace, _pod("b", node, [new_in_use, old_in_use]))
    rest.create(kube.api, "pods", namespace, _pod("c", f"{node}-other", [elsewhere]))
    views = DigestViews(cache, lambda: [old_in_use, new_in_use, oldest_unused])
    views.sync()  # a view of an unused digest too (its pod just left): it goes with the blob
    # Held: 11 MB; budget 6 MB. In use: 4 MB. Unused, LRU order: elsewhere (1), oldest (2),
    # older (2), recent (2): evicting the first three leaves 11 - 5 = 6 MB, which fits.
    evictor = Evictor(cache, views, pods_on_node(reader, node, _fetch_of), 6 * MB)

    done = asyncio.run(_once_and_close(evictor, reader))

    assert done.held_bytes == 11 * MB
    assert done.evicted == [elsewhere, oldest_unused, older_unused]
    assert set(cache.held()) == {old_in_use, new_in_use, recent_unused}
    assert not (views.view(oldest_unused) / "data").exists()  # no hard link keeps its bytes
    assert (views.view(old_in_use) / "data").exists()


def test_in_use_models_are_kept_even_over_budget_and_a_failed_list_evicts_nothing(
    kube: Kube, namespace: str, tmp_path: Path, reader: KubeClient
) -> None:
    node = f"{namespace}-node"
    cache = ContentCache(tmp_path / "cache")
    big = _blob(cache, 3 * MB, age_s=1000)
    unused = _blob(cache, 1 * MB, age_s=500)
    rest.create(kube.api, "pods", namespace, _pod("a", node, [big]))
    views = DigestViews(cache, lambda: [])
    in_use = pods_on_node(reader, node, _fetch_of)

    async def two_passes() -> Any:
        try:
            done = await Evictor(cache, views, in_use, 1 * MB).once()
            assert done.evicted == [unused] and set(cache.held()) == {big}  # over budget, kept
            # A pod the agent's watch has not resolved yet: it cannot tell, so nothing goes.
            with pytest.raises(Unresolved):
                await Evictor(cache, views, pods_on_node(reader, node, _unresolved), 0).once()
            assert set(cache.held()) == {big}
            # The API server cannot be asked (here: the token is refused): nothing is evicted.
            reader._endpoint.token_file.write_text("not-a-token")
            with pytest.raises(ApiError) as info:
                await Evictor(cache, views, in_use, 0).once()
            return info.value
        finally:
            await reader.aclose()

    err = asyncio.run(two_passes())
    assert err.status == 401, err
    assert set(cache.held()) == {big}


async def _once_and_close(evictor: Evictor, reader: KubeClient | None) -> Any:
    try:
        return await evictor.once()
    finally:
        if reader is not None:
            await reader.aclose()
