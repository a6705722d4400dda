"""One origin download per site, on the real API server: three node agents of one site
(processes, each with a token bound to a pod on its own Node) fetch one file; the test origin
counts the bytes it sends. The chart's policies hold: an agent's token writes only its own
Node's peer annotations, its cache labels and Leases in its own name. A wrong sha256 is
downloaded once for the whole site and lands nothing in any cache: every agent records
ChecksumMismatch. Each agent labels its Node with what its cache holds (the scheduler's
preference), and takes the label off when the file is gone."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.cache import cache_label
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.site import CACHE_ANNOTATION, PEER_ANNOTATION, lease_name, short

from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import SiteWorld
from tests.support.waiting import wait_for
from tests.thermal.kube_support import TcpProxy, api_server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SIZE = 4 * (1 << 20) + 321
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        world.add_nodes(["127.0.0.1"] * 3)
        yield world


def _start(world: SiteWorld, kube: Kube, url: str, sha: str) -> None:
    world.want([{"url": url, "sha256": sha, "sizeBytes": SIZE}])
    world.start(str(kube.api.configuration.host), extra=["--lease_seconds=6"])


def test_three_agents_one_origin_download(world: SiteWorld, kube: Kube) -> None:
    with serve({"m.gguf": DATA}) as (base, origin):
        _start(world, kube, f"{base}/m.gguf", SHA)
        world.wait(
            lambda: all(a.cache.has(SHA, SIZE) for a in world.agents), 120, "all three caches"
        )
        assert origin.bytes_sent == SIZE, (origin.bytes_sent, world.logs())
        assert len(origin.requests) == 1
    for agent in world.agents:
        assert agent.cache.path(SHA).read_bytes() == DATA
    (lease,) = world.leases()
    assert lease.metadata.name == lease_name(world.site, SHA)
    holder = lease.spec.holder_identity
    assert holder in world.nodes
    # Every agent says what it holds and where, on its own Node.
    world.wait(
        lambda: all(
            short(SHA) in _annotations(kube, n).get(CACHE_ANNOTATION, "") for n in world.nodes
        ),
        30,
        "the cache annotations",
    )
    assert all(_annotations(kube, n)[PEER_ANNOTATION].startswith("127.0.0.1:") for n in world.nodes)
    # ... and labels its Node for the scheduler (operator: a preferred nodeAffinity term).
    world.wait(
        lambda: all(_labels(kube, n).get(cache_label(SHA)) == "true" for n in world.nodes),
        30,
        "the cache labels",
    )
    origin_logs = [a.node for a in world.agents if "from the origin" in a.log.read_text()]
    assert origin_logs == [holder], world.logs()
    assert world.stop_agents() == [0, 0, 0]  # SIGTERM stops each cleanly


def test_a_holder_that_stops_renewing_is_taken_over(world: SiteWorld, kube: Kube) -> None:
    """The holder is killed (SIGKILL: no word to anyone) mid-download; after leaseSeconds
    another agent takes the Lease over and the site still gets the file. The origin pace is
    the agents' maxBandwidth (500 kB/s), which also keeps the first download long enough."""
    rate = 500_000
    with serve({"m.gguf": DATA}) as (base, origin):
        world.want([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": SIZE}])
        world.start(
            str(kube.api.configuration.host),
            extra=["--lease_seconds=4", f"--origin_max_bytes_per_second={rate}"],
        )
        world.wait(lambda: bool(world.leases()), 60, "the fetch Lease")
        first = world.leases()[0].spec.holder_identity
        (victim,) = [a for a in world.agents if a.node == first]
        world.wait(lambda: origin.bytes_sent > 0, 30, "the first origin bytes")
        assert victim.proc is not None
        victim.proc.kill()
        victim.proc.wait()
        victim.proc = None
        sent_before = origin.bytes_sent
        rest = [a for a in world.agents if a is not victim]
        took = world.wait(lambda: all(a.cache.has(SHA, SIZE) for a in rest), 120, "the takeover")
        assert not victim.cache.has(SHA, SIZE)
        (lease,) = world.leases()
        assert lease.spec.holder_identity != first and lease.spec.lease_transitions >= 1
        # The new holder starts its own copy: the killed one's bytes are the only extra.
        assert origin.bytes_sent <= SIZE + sent_before + (1 << 20), world.logs()
        # Paced at `rate` after the burst: the whole file cannot have taken less.
        assert took >= (SIZE - (2 << 20)) / rate, took


def test_a_partitioned_site_still_shares(world: SiteWorld, kube: Kube) -> None:
    """The API server goes away for every agent (a proxy cut) while the holder downloads: the
    holder finishes what it started, the others ask the peers they knew directly and get the
    file from it; nobody else goes to the origin (origin_wait_seconds is 600)."""
    proxy = TcpProxy(api_server(kube))
    proxy.restore()
    try:
        with serve({"m.gguf": DATA}) as (base, origin):
            world.want([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": SIZE}])
            world.start(
                f"https://127.0.0.1:{proxy.port}",
                extra=["--lease_seconds=6", "--origin_max_bytes_per_second=500000"],
            )
            world.wait(lambda: origin.bytes_sent > 0, 60, "the holder's first origin bytes")
            world.wait(
                lambda: all(PEER_ANNOTATION in _annotations(kube, n) for n in world.nodes),
                30,
                "every peer address",
            )
            time.sleep(1)  # the agents' node watches have delivered them
            assert not any(a.cache.has(SHA, SIZE) for a in world.agents)
            proxy.cut()
            world.wait(
                lambda: all(a.cache.has(SHA, SIZE) for a in world.agents), 120, "the partition"
            )
            assert origin.bytes_sent == SIZE and len(origin.requests) == 1, world.logs()
    finally:
        proxy.cut()
    peers = [a.node for a in world.agents if "from the peer" in a.log.read_text()]
    assert len(peers) == 2, world.logs()


def _annotations(kube: Kube, node: str) -> dict[str, str]:
    body: Any = kube.core.read_node(node)
    return dict(body.metadata.annotations or {})


def _labels(kube: Kube, node: str) -> dict[str, str]:
    body: Any = kube.core.read_node(node)
    return dict(body.metadata.labels or {})


def test_cache_labels_follow_the_cache(world: SiteWorld, kube: Kube) -> None:
    """Without site sharing too (the labels are not a site feature): each agent labels its own
    Node once the file is in; a label for a file its cache no longer holds — one left from
    before the agent started, and one whose file is deleted while it runs — is taken off; no
    other label of the Node is touched."""
    stale = cache_label("f" * 64)
    first = world.nodes[0]
    kube.core.patch_node(first, {"metadata": {"labels": {stale: "true"}}})
    with serve({"m.gguf": DATA}) as (base, _):
        world.want([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": SIZE}])
        world.start(
            str(kube.api.configuration.host), sharing=False, extra=["--label_resync_seconds=1"]
        )
        world.wait(
            lambda: all(_labels(kube, n).get(cache_label(SHA)) == "true" for n in world.nodes),
            60,
            "every node's cache label",
        )
    assert stale not in _labels(kube, first), world.logs()
    (agent,) = [a for a in world.agents if a.node == first]
    agent.cache.path(SHA).unlink()  # gone from the node (a disk cleanup, say)
    world.wait(lambda: cache_label(SHA) not in _labels(kube, first), 30, "the label to go")
    others = [n for n in world.nodes if n != first]
    assert all(_labels(kube, n).get(cache_label(SHA)) == "true" for n in others)
    assert _labels(kube, first)["ember.dev/site"] == world.site


def test_wrong_sha256_is_fetched_once_and_lands_nowhere(world: SiteWorld, kube: Kube) -> None:
    wrong = hashlib.sha256(b"not these bytes").hexdigest()
    with serve({"m.gguf": DATA}) as (base, origin):
        _start(world, kube, f"{base}/m.gguf", wrong)
        world.wait(
            lambda: all(a.cache.failure(wrong) for a in world.agents), 120, "every failure record"
        )
        assert len(origin.requests) == 1 and origin.bytes_sent == SIZE, world.logs()
    for agent in world.agents:
        line = agent.cache.failure(wrong)
        assert line is not None and line.startswith("ChecksumMismatch: "), line
        assert agent.cache.held() == []
        assert sorted(p.name for p in agent.cache.blobs.iterdir()) == []


def _client(world: SiteWorld, kube: Kube, node: str) -> httpx.Client:
    sa = world.tmp / f"sa-{node}"
    return httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
        timeout=10,
    )


def test_agent_writes_only_its_own_annotations_and_leases(world: SiteWorld, kube: Kube) -> None:
    """The policies, with tokens made exactly as the agents' are (no agent running)."""
    with serve({"m.gguf": DATA}) as (base, _):
        world.want([{"url": f"{base}/m.gguf", "sha256": SHA, "sizeBytes": SIZE}])
    own, other = world.nodes[0], world.nodes[1]
    world._token(own)  # writes sa-<own>
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{world.namespace}/leases"

    def lease(name: str, holder: str) -> dict[str, object]:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 5},
        }

    def annotate(node: str, key: str) -> httpx.Response:
        # A new value each time: re-writing a value already there is no change to refuse.
        body = json.dumps({"metadata": {"annotations": {key: uuid.uuid4().hex}}})
        return http.patch(f"/api/v1/nodes/{node}", content=body, headers=MERGE)

    with _client(world, kube, own) as http:
        wait_for(  # a fresh policy takes a moment to load
            "the annotations policy to refuse a probe",
            lambda: annotate(own, "ember.dev/probe").status_code,
            30,
            0.5,
            until=lambda code: code == 403,
        )
        assert annotate(own, PEER_ANNOTATION).status_code == 200
        refused = annotate(other, PEER_ANNOTATION)
        assert refused.status_code == 403 and "own node" in refused.text
        # Its peer key only on its own Node: no agent publishes a key in another node's name.
        assert annotate(own, peerauth.KEY_ANNOTATION).status_code == 200
        forged = annotate(other, peerauth.KEY_ANNOTATION)
        assert forged.status_code == 403 and "own node" in forged.text

        def label(node: str, labels: dict[str, str | None]) -> httpx.Response:
            body = json.dumps({"metadata": {"labels": labels}})
            return http.patch(f"/api/v1/nodes/{node}", content=body, headers=MERGE)

        site = label(own, {"ember.dev/site": "elsewhere"})
        assert site.status_code == 403 and "cache.ember.dev/ labels" in site.text
        mine = cache_label(SHA)
        assert label(own, {mine: "true"}).status_code == 200
        assert label(own, {mine: "yes"}).status_code == 403  # only "true"
        assert label(own, {"cache.ember.dev/not-a-digest": "true"}).status_code == 403
        assert label(own, {"cache.ember.dev/" + "A" * 16: "true"}).status_code == 403
        assert label(own, {"other.example/" + SHA[:16]: "true"}).status_code == 403
        foreign = label(other, {mine: "true"})
        assert foreign.status_code == 403 and "own node" in foreign.text
        assert label(own, {mine: None}).status_code == 200  # and may take it off again
        taint = http.patch(
            f"/api/v1/nodes/{own}",
            content=json.dumps({"spec": {"unschedulable": True}}),
            headers=MERGE,
        )
        assert taint.status_code == 403
        first, second = lease_name(world.site, SHA), lease_name(world.site, "0" * 64)
        # The node -> site map was just written into the Lease policy (add_nodes); the API
        # server loads a changed policy within a second or so: retry its first use until then.
        wait_for(
            "the Lease policy's new map",
            lambda: http.post(leases, json=lease(first, own)).status_code == 201,
            15,
            0.5,
        )
        foreign = http.post(leases, json=lease(second, other))
        assert foreign.status_code == 403 and "own node" in foreign.text
        assert http.post(leases, json=lease("other-lease", own)).status_code == 403
        assert http.get(leases).status_code == 403  # get by name only: no list
        assert http.delete(f"{leases}/{first}").status_code == 403
