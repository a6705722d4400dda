"""Who can make the node agent fetch, and whose failure is whose (issue 34, holes 1-3).

The real agent (a process per node, `site_support.SiteWorld`) on the real API server, through
the chart's RBAC and policies, against real origins and a real (hostile) peer on local sockets:

1. A tenant who can create pods, but whose pod no InferenceDeployment of its namespace owns,
   cannot make the agent request a URL or send an origin Secret: what the agent fetches comes
   from an InferenceDeployment's spec in the pod's own namespace, never from the pod.
2. A peer that sends wrong bytes and hangs up does not fail the site: its bytes are dropped, the
   file comes whole from the origin, and no failure is recorded on the node or the Lease.
3. Tenant A's wrong URL for a digest does not fail tenant B's pod that names the right URL for
   the same digest: failures are kept per (digest, URL).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, Want
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.site import (
    CACHE_ANNOTATION,
    FAILED_ANNOTATION,
    PEER_ANNOTATION,
    Leases,
    SiteConfig,
    lease_name,
    short,
)
from kubernetes import client

from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import (
    SiteWorld,
    claim_metadata,
    model_spec,
    put_inference_deployment,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SIZE = 4 * (1 << 20) + 77  # a few of the cache's 1 MiB write chunks
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
WRONG = os.urandom(SIZE)  # same size, other bytes
TOKEN = "origin-token-that-must-stay-home"


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        yield world


@pytest.fixture
def tenants(kube: Kube) -> Iterator[Callable[[], str]]:
    """Namespaces of tenants (not the agent's), removed afterwards."""
    made: list[str] = []

    def make() -> str:
        name = f"tenant-{uuid.uuid4().hex[:8]}"
        meta = client.V1ObjectMeta(name=name)
        kube.core.create_namespace(client.V1Namespace(metadata=meta))
        made.append(name)
        return name

    yield make
    for name in made:
        kube.core.delete_namespace(name, grace_period_seconds=0)


def tenant_pod(name: str, node: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """A pod as a tenant writes it: on the agent's node, any labels and annotations."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **metadata},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "c", "image": "ember-runtime:never"}],
        },
    }


def _origin_secret(kube: Kube, namespace: str, name: str, prefix: str) -> None:
    data = {"token": TOKEN, "urlPrefix": prefix}
    body: Any = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }
    kube.core.create_namespaced_secret(namespace, body)


def _start(world: SiteWorld, kube: Kube, **kwargs: Any) -> None:
    world.start(str(kube.api.configuration.host), **kwargs)


def test_a_tenant_pod_cannot_make_the_agent_fetch_for_it(
    world: SiteWorld, kube: Kube, tenants: Callable[[], str]
) -> None:
    """Hole 1. Two hand-made pods on the agent's node: one with the old fetch annotation (a URL
    and the agent's origin Secret), one naming an InferenceDeployment that exists only in the
    agent's namespace (whose spec uses that Secret). A real InferenceDeployment's pod in the
    tenant's namespace is the control: its file is fetched, so the agent was watching."""
    (node,) = world.add_nodes(["127.0.0.1"])
    world.want(None)  # the agent's own pod (its token is bound to it); it wants nothing
    tenant = tenants()
    files = {"good.gguf": DATA, "evil.gguf": WRONG, "private.gguf": WRONG}
    with serve(files) as (base, origin):
        _origin_secret(kube, world.namespace, "origin", base)
        evil = {"url": f"{base}/evil.gguf", "sha256": hashlib.sha256(WRONG).hexdigest()}
        forged = {"secretRef": "origin", "files": [{**evil, "sizeBytes": SIZE}]}
        # (a) the annotation the agent used to obey, plus a claim naming nothing
        meta_a = {
            "labels": {INSTANCE_LABEL: "ghost"},
            "annotations": {
                "ember.dev/model-fetch": json.dumps(forged),
                FETCH_HASH_ANNOTATION: "x",
            },
        }
        # (b) naming an object of the agent's namespace (its spec sends the Secret)
        private = [{"url": f"{base}/private.gguf", "sha256": evil["sha256"], "sizeBytes": SIZE}]
        private_model = model_spec(private, secret="origin")
        put_inference_deployment(kube, world.namespace, "private", private_model)
        meta_b = claim_metadata("private", private_model)
        for name, meta in (("forged", meta_a), ("cross-namespace", meta_b)):
            pod: Any = tenant_pod(name, node, meta)
            kube.core.create_namespaced_pod(tenant, pod)
        # The control: an InferenceDeployment of the tenant's namespace and a pod of it.
        good = [{"url": f"{base}/good.gguf", "sha256": SHA, "sizeBytes": SIZE}]
        put_inference_deployment(kube, tenant, "legit", model_spec(good))
        control: Any = tenant_pod("legit-0", node, claim_metadata("legit", model_spec(good)))
        _start(world, kube, sharing=False)
        kube.core.create_namespaced_pod(tenant, control)
        (agent,) = world.agents
        world.wait(
            lambda: agent.cache.has(SHA, SIZE) or bool(set(origin.paths) - {"/good.gguf"}),
            60,
            "the control's file (or a forged request)",
        )
        time.sleep(2)  # a forged request would come within this
        asked = list(origin.paths)
        leaked = [r for r in origin.requests if "authorization" in r]
    assert asked == ["/good.gguf"], f"the agent requested {asked}\n{world.logs()}"
    assert leaked == [], "the origin Secret was sent"
    assert agent.cache.path(SHA).read_bytes() == DATA


def test_a_peer_that_sends_wrong_bytes_and_cuts_does_not_fail_the_site(
    world: SiteWorld, kube: Kube
) -> None:
    """Hole 2. The site's other node (compromised: its own key, its answers signed) advertises
    the file and serves wrong bytes that stop short. The victim drops them, takes the Lease,
    fetches the file whole from the origin, and records no failure, on the node or the Lease."""
    liar, victim = world.add_nodes(["127.0.0.1", "127.0.0.1"])

    def site_key(node: str) -> str | None:  # the liar knows its site's published keys
        found: Any = kube.core.read_node(node)
        return (found.metadata.annotations or {}).get(peerauth.KEY_ANNOTATION)

    lies = ContentCache(world.tmp / "liar-cache")
    lies.blobs.mkdir(parents=True)
    lies.path(SHA).write_bytes(WRONG[: 3 << 19])  # 1.5 MiB of other bytes under D's name
    me = peerauth.Identity(liar)
    peer = PeerServer(lies, me, site_key, "127.0.0.1", 0)
    peer.start()
    try:
        with serve({"m.gguf": DATA}) as (base, origin):
            note = {
                PEER_ANNOTATION: f"127.0.0.1:{peer.port}",
                CACHE_ANNOTATION: short(SHA),
                peerauth.KEY_ANNOTATION: me.public,
            }
            kube.core.patch_node(liar, {"metadata": {"annotations": note}})
            world.want(None)
            _start(world, kube, only=[victim], extra=["--lease_seconds=6"])
            (agent,) = world.agents

            def published() -> bool:  # the victim has read its site (and so its peers)
                node: Any = kube.core.read_node(victim)
                return PEER_ANNOTATION in (node.metadata.annotations or {})

            world.wait(published, 60, "the victim to join its site")
            time.sleep(1)
            world.announce([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": SIZE}])
            world.wait(
                lambda: agent.cache.has(SHA, SIZE) or agent.cache.failure(SHA) is not None,
                90,
                "the file or a failure",
            )
            took = peer.bytes_served
            assert took, f"the victim never took the lying peer's bytes\n{world.logs()}"
            failure = agent.cache.failure(SHA)
            leases = world.leases()
            sent = origin.bytes_sent
    finally:
        peer.close()
    assert failure is None, f"recorded on the node: {failure}\n{world.logs()}"
    lease_failures = [(lease.metadata.annotations or {}).get(FAILED_ANNOTATION) for lease in leases]
    assert lease_failures == [None], f"recorded on the Lease: {lease_failures}"
    assert agent.cache.path(SHA).read_bytes() == DATA
    assert not agent.cache.partial(SHA).exists()
    assert sent == SIZE  # whole from the origin: nothing resumed onto the peer's bytes


def test_a_wrong_url_from_one_tenant_does_not_block_another(
    world: SiteWorld, kube: Kube, tenants: Callable[[], str]
) -> None:
    """Hole 3. Tenant A names digest D with a URL whose bytes are not D; A's pod is told
    ChecksumMismatch. Tenant B then names D with the right URL: B's file is fetched and the
    node's failure record for D goes (B's prewarm never reads A's failure)."""
    (node,) = world.add_nodes(["127.0.0.1"])
    world.want(None)
    a, b = tenants(), tenants()
    with serve({"right.gguf": DATA, "wrong.gguf": WRONG}) as (base, origin):
        wrong = model_spec([{"url": f"{base}/wrong.gguf", "sha256": SHA, "sizeBytes": SIZE}])
        right = model_spec([{"url": f"{base}/right.gguf", "sha256": SHA, "sizeBytes": SIZE}])
        put_inference_deployment(kube, a, "model", wrong)
        put_inference_deployment(kube, b, "model", right)
        pod_a: Any = tenant_pod("a-0", node, claim_metadata("model", wrong))
        kube.core.create_namespaced_pod(a, pod_a)
        _start(world, kube, sharing=False)
        (agent,) = world.agents
        world.wait(lambda: agent.cache.failure(SHA) is not None, 60, "A's failure")
        line = agent.cache.failure(SHA)
        assert line is not None and line.startswith(f"{reasons.CHECKSUM_MISMATCH}: ")
        pod_b: Any = tenant_pod("b-0", node, claim_metadata("model", right))
        kube.core.create_namespaced_pod(b, pod_b)
        world.wait(lambda: agent.cache.has(SHA, SIZE), 60, "B's file")
        asked = list(origin.paths)
    assert agent.cache.path(SHA).read_bytes() == DATA
    assert agent.cache.failure(SHA) is None
    assert asked == ["/wrong.gguf", "/right.gguf"], asked  # A's URL is not tried again


def test_a_failure_on_the_lease_expires_and_is_retried(world: SiteWorld, kube: Kube) -> None:
    """Hole 2's 'failures expire': a holder's ChecksumMismatch on the site Lease stands for the
    others for `failure_seconds` by their own clock, then the next asker takes the Lease over
    (with the failure cleared) and downloads again. The real Leases code, with each node's own
    bound token, through the chart's Lease policy; only the clock is the test's."""
    holder, other = world.add_nodes(["127.0.0.1", "127.0.0.1"])
    world.want(None)
    url = "http://origin.example/m.gguf"
    want = Want(url, SHA, SIZE)
    now = [0.0]

    async def scenario() -> None:
        readers = [_reader(world, kube, node) for node in (holder, other)]
        try:
            first, second = (
                Leases(
                    r, SiteConfig(node=n, namespace=world.namespace, peer_port=0), lambda: now[0]
                )
                for r, n in zip(readers, (holder, other), strict=True)
            )
            name = lease_name(world.site, SHA)
            assert (await first.acquire(name, world.site, want)).mine
            await first.mark_failed(name, url, "ChecksumMismatch: expected ab… got cd…")
            seen = await second.acquire(name, world.site, want)
            assert seen.failed is not None and not seen.mine  # the site's failure, for now
            now[0] += 299.0
            assert (await second.acquire(name, world.site, want)).failed is not None
            now[0] += 2.0  # past failure_seconds (300) since `other` first saw it
            retried = await second.acquire(name, world.site, want)
            assert retried.mine and retried.failed is None
            lease: Any = await readers[1].get(
                f"/apis/coordination.k8s.io/v1/namespaces/{world.namespace}/leases/{name}"
            )
            assert FAILED_ANNOTATION not in (lease["metadata"].get("annotations") or {})
            assert lease["spec"]["holderIdentity"] == other
        finally:
            for r in readers:
                await r.aclose()

    asyncio.run(scenario())


def _reader(world: SiteWorld, kube: Kube, node: str) -> KubeClient:
    sa = world._token(node)
    endpoint = Endpoint(str(kube.api.configuration.host), sa / "token", sa / "ca.crt")
    return KubeClient(endpoint)
