"""A rollout's stage requests on the real API server: the node agent's real Fetcher, CacheLabels
and Evictor, in this process, with a token bound to the agent's own pod on its node, through the
chart's RBAC and admission policies (`site_support.SiteWorld`); a real origin; a real cache on a
tmp dir.

(a) A stage request on the agent's own Node makes it fetch the named InferenceDeployment's
    spec.model with no pod on the node, and the Node's cache label appears; removing the
    annotation drops it from what is wanted, and the file stays cached.
(b) A request whose key does not match its value, or that names an object of a namespace that
    has none, fetches nothing (a correct request beside them is the control).
(c) While a request stands, the evictor keeps the object's spec.model and its
    status.rollout.stableSpec.model (the version a rollback returns to) over budget; an object
    it cannot read makes the pass evict nothing; after the annotation goes, the stable blob goes.
(d) A correct request on another node is ignored by this agent, for fetching and for eviction.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from ember_operator.apply import request
from ember_runtime.contract.cache import cache_label
from ember_runtime.contract.rollout import stable_model, stage_annotation
from ember_runtime.kube import ApiError, Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.evict import Evictor, InUse, pods_on_node, staged_on_node, together
from ember_runtime.nodeagent.fetcher import Fetcher, SpecResolver
from ember_runtime.nodeagent.labels import CacheLabels
from ember_runtime.nodeagent.views import DigestViews
from kubernetes import client

from tests.conftest import Kube
from tests.nodeagent.blobs import aged_blob
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import SiteWorld, model_spec, put_inference_deployment
from tests.operator import rest
from tests.support.waiting import wait_for
from tests.thermal.kube_support import token_dir

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

MB = 1_000_000
DATA = os.urandom(2 * (1 << 20) + 99)
SHA = hashlib.sha256(DATA).hexdigest()
WRONG = os.urandom(1 << 20)
WRONG_SHA = hashlib.sha256(WRONG).hexdigest()


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        yield world


@pytest.fixture
def tenant(kube: Kube) -> Iterator[str]:
    """A namespace of a tenant (not the agent's), removed afterwards."""
    name = f"tenant-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    kube.core.delete_namespace(name, grace_period_seconds=0)


def _annotate(kube: Kube, node: str, annotations: dict[str, str | None]) -> None:
    kube.core.patch_node(node, {"metadata": {"annotations": annotations}})


def _file(base: str, path: str, data: bytes) -> dict[str, Any]:
    return {
        "url": f"{base}/{path}",
        "sha256": hashlib.sha256(data).hexdigest(),
        "sizeBytes": len(data),
    }


def _agent_nodes(world: SiteWorld, count: int = 1) -> list[str]:
    """Nodes with no kubelet, and per node the agent's own pod (claiming nothing), which its
    token is bound to. No site Leases: these agents fetch from the origin themselves."""
    nodes = world.add_nodes(["127.0.0.1"] * count, map_sites=False)
    world.want(None)
    return nodes


def _reader(world: SiteWorld, kube: Kube, node: str) -> KubeClient:
    sa = world._token(node)
    return KubeClient(Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt"))


async def _until(done: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `done` off the loop (it may ask the API server) until true."""
    await asyncio.to_thread(wait_for, what, done, timeout, 0.1)


@asynccontextmanager
async def _running(*loops: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """The agent's loops as tasks; cancelled (and awaited) on the way out; one that ends
    early is a failure."""
    tasks = [asyncio.create_task(c) for c in loops]
    try:
        yield
        for task in tasks:
            if task.done():
                raise AssertionError(f"{task.get_name()} ended: {task.exception()!r}")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _labelled(kube: Kube, node: str, sha: str) -> bool:
    found: Any = kube.core.read_node(node)
    return (found.metadata.labels or {}).get(cache_label(sha)) == "true"


def test_a_stage_request_fetches_the_spec_with_no_pod_on_the_node(
    world: SiteWorld, kube: Kube, tenant: str
) -> None:
    (node,) = _agent_nodes(world)
    key, value = stage_annotation(tenant, "app")
    cache = ContentCache(world.tmp / "cache")
    with serve({"new.gguf": DATA}) as (base, origin):
        put_inference_deployment(kube, tenant, "app", model_spec([_file(base, "new.gguf", DATA)]))
        _annotate(kube, node, {key: value})

        async def scenario() -> None:
            reader = _reader(world, kube, node)
            labels = CacheLabels(cache, reader, node, resync_seconds=1)
            fetcher = Fetcher(cache, reader, node, world.namespace, labels=labels, retry_seconds=1)
            async with _running(fetcher.run(), labels.run()):
                await _until(lambda: _labelled(kube, node, SHA), 60, "the cache label")
                assert set(fetcher.wanted()) == {SHA} and fetcher.pods == {}
                _annotate(kube, node, {key: None})
                await _until(lambda: fetcher.wanted() == {}, 30, "the request to drop")
            await reader.aclose()

        asyncio.run(scenario())
    assert origin.paths == ["/new.gguf"]
    assert cache.path(SHA).read_bytes() == DATA  # dropped, not evicted
    assert _labelled(kube, node, SHA)


def test_a_forged_or_dangling_request_fetches_nothing(
    world: SiteWorld, kube: Kube, tenant: str
) -> None:
    """On the agent's own Node: `evil`'s value under another object's key; a correctly keyed
    request for `evil` in the agent's namespace (it lives in the tenant's); one for a namespace
    that does not exist. The control, a correct request for `legit`, is fetched."""
    (node,) = _agent_nodes(world)
    cache = ContentCache(world.tmp / "cache")
    with serve({"good.gguf": DATA, "evil.gguf": WRONG}) as (base, origin):
        put_inference_deployment(
            kube, tenant, "evil", model_spec([_file(base, "evil.gguf", WRONG)])
        )
        put_inference_deployment(
            kube, tenant, "legit", model_spec([_file(base, "good.gguf", DATA)])
        )
        forged_key, _ = stage_annotation(tenant, "other")
        requests = dict(
            [
                (forged_key, f"{tenant}/evil"),
                stage_annotation(world.namespace, "evil"),
                stage_annotation(f"gone-{uuid.uuid4().hex[:6]}", "evil"),
                stage_annotation(tenant, "legit"),
            ]
        )
        _annotate(kube, node, dict(requests))

        async def scenario() -> set[tuple[str, str]]:
            reader = _reader(world, kube, node)
            fetcher = Fetcher(cache, reader, node, world.namespace, retry_seconds=1)
            async with _running(fetcher.run()):
                await _until(lambda: cache.has(SHA, len(DATA)), 60, "the control's file")
                await asyncio.sleep(2)  # a forged request would be fetched within this
            await reader.aclose()
            return set(fetcher.staged)

        staged = asyncio.run(scenario())
    assert origin.paths == ["/good.gguf"], origin.paths
    assert staged == {(tenant, "legit")}
    assert not cache.has(WRONG_SHA, len(WRONG))


def _roll_out(kube: Kube, namespace: str, name: str, stable: dict[str, Any]) -> None:
    """status.rollout with the previous version's model, as the operator writes it."""
    body = {"status": {"rollout": {"phase": "Progressing", "stableSpec": {"model": stable}}}}
    path = rest.path("infd", namespace, name) + "/status"
    request(kube.api, "PATCH", path, body=body, content_type="application/merge-patch+json")
    stored = stable_model(rest.get(kube.api, "infd", namespace, name) or {})
    assert stored == stable, "the CRD did not keep status.rollout.stableSpec (crds/ stale?)"


def _in_use(reader: KubeClient, node: str, fetcher: Fetcher) -> InUse:
    """What the agent's evictor counts as in use (__main__'s wiring)."""
    return together(
        pods_on_node(reader, node, fetcher.fetch_of),
        staged_on_node(reader, node, SpecResolver(reader)),
    )


def _pods_and_nodes_reader(kube: Kube, namespace: str, tmp: Path) -> KubeClient:
    """A token that may read Nodes and list pods, not InferenceDeployments."""
    name = f"{namespace}-no-infd"
    rbac = client.RbacAuthorizationV1Api(kube.api)
    meta = client.V1ObjectMeta(name=name)
    kube.core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=meta))
    rules = [
        client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"]),
        client.V1PolicyRule(api_groups=[""], resources=["nodes"], verbs=["get"]),
    ]
    rbac.create_cluster_role(client.V1ClusterRole(metadata=meta, rules=rules))
    subject = client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)
    ref = client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name)
    binding = client.V1ClusterRoleBinding(metadata=meta, role_ref=ref, subjects=[subject])
    rbac.create_cluster_role_binding(binding)
    token_request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[])
    )
    answer: Any = kube.core.create_namespaced_service_account_token(name, namespace, token_request)
    sa = token_dir(kube, str(answer.status.token), tmp / "sa-no-infd")
    return KubeClient(Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt"))


def _drop_role(kube: Kube, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(kube.api)
    rbac.delete_cluster_role_binding(f"{namespace}-no-infd")
    rbac.delete_cluster_role(f"{namespace}-no-infd")


def test_while_a_request_stands_the_stable_version_is_kept_over_budget(
    world: SiteWorld, kube: Kube, tenant: str
) -> None:
    (node,) = _agent_nodes(world)
    cache = ContentCache(world.tmp / "cache")
    stable, _ = aged_blob(cache, 2 * MB, age_s=5000)  # the previous version: the oldest of all
    new, _ = aged_blob(cache, 1 * MB, age_s=100)  # the version rolling out, staged
    unused, _ = aged_blob(cache, 1 * MB, age_s=10)  # nobody's, and the newest
    files = {"new.gguf": {"url": "https://origin.example/new.gguf", "sha256": new, "sizeBytes": MB}}
    stable_files = [
        {"url": "https://origin.example/old.gguf", "sha256": stable, "sizeBytes": 2 * MB}
    ]
    put_inference_deployment(kube, tenant, "app", model_spec(list(files.values())))
    _roll_out(kube, tenant, "app", model_spec(stable_files))
    # A second staged object whose stable model is malformed: logged and ignored, not a failure.
    put_inference_deployment(kube, tenant, "odd", model_spec(list(files.values())))
    _roll_out(kube, tenant, "odd", {"source": "not-an-object", "files": "nor-a-list"})
    key, value = stage_annotation(tenant, "app")
    odd_key, odd_value = stage_annotation(tenant, "odd")
    _annotate(kube, node, {key: value, odd_key: odd_value})
    views = DigestViews(cache, lambda: [])

    async def scenario() -> list[list[str]]:
        reader = _reader(world, kube, node)
        refused = _pods_and_nodes_reader(kube, world.namespace, world.tmp)
        fetcher = Fetcher(cache, reader, node, world.namespace)
        try:
            # The staged objects cannot be read: the pass cannot tell, so nothing goes.
            with pytest.raises(ApiError) as info:
                await Evictor(cache, views, _in_use(refused, node, fetcher), 1 * MB).once()
            assert info.value.status == 403
            assert set(cache.held()) == {stable, new, unused}
            first = await Evictor(cache, views, _in_use(reader, node, fetcher), 1 * MB).once()
            _annotate(kube, node, {key: None, odd_key: None})  # the rollout is over
            second = await Evictor(cache, views, _in_use(reader, node, fetcher), 1 * MB).once()
            return [first.evicted, second.evicted]
        finally:
            fetcher._http.close()
            await reader.aclose()
            await refused.aclose()
            _drop_role(kube, world.namespace)

    first, second = asyncio.run(scenario())
    assert first == [unused]  # over budget (3 MB in use), yet both versions stay
    assert stable in second and stable not in cache.held()  # 2 MB alone is over 1 MB


def test_a_request_on_another_node_is_ignored(world: SiteWorld, kube: Kube, tenant: str) -> None:
    """Another node of the cluster carries correct requests: for `evil` (not cached here) and
    for `held` (cached here before). This agent neither fetches the one nor keeps the other,
    while its own request (the control) is fetched and kept."""
    mine, other = _agent_nodes(world, 2)
    cache = ContentCache(world.tmp / "cache")
    held, held_data = aged_blob(cache, MB, age_s=1000)
    with serve({"good.gguf": DATA, "evil.gguf": WRONG, "held.gguf": held_data}) as (base, origin):
        for name, path, data in (
            ("evil", "evil.gguf", WRONG),
            ("held", "held.gguf", held_data),
            ("legit", "good.gguf", DATA),
        ):
            put_inference_deployment(kube, tenant, name, model_spec([_file(base, path, data)]))
        theirs = dict([stage_annotation(tenant, "evil"), stage_annotation(tenant, "held")])
        _annotate(kube, other, dict(theirs))
        _annotate(kube, mine, dict([stage_annotation(tenant, "legit")]))

        async def scenario() -> list[str]:
            reader = _reader(world, kube, mine)
            fetcher = Fetcher(cache, reader, mine, world.namespace, retry_seconds=1)
            evictor = Evictor(
                cache, DigestViews(cache, lambda: []), _in_use(reader, mine, fetcher), 0
            )
            async with _running(fetcher.run()):
                await _until(lambda: cache.has(SHA, len(DATA)), 60, "the control's file")
                await asyncio.sleep(2)  # another node's request would be fetched within this
                done = await evictor.once()
            await reader.aclose()
            return done.evicted

        evicted = asyncio.run(scenario())
    assert origin.paths == ["/good.gguf"], origin.paths
    assert evicted == [held]  # named only by the other node's request: not kept here
    assert set(cache.held()) == {SHA}  # over budget (0), but this node's request keeps it
