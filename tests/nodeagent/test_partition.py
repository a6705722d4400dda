"""Site sharing with the API server unreachable (a real closed port, not a mocked client): the
agent fetches from the site peers it already knew, asking them directly, and goes to the origin
only after `origin_wait_seconds`. Real peer server, real origin, real caches."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, Want
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.site import (
    Peer,
    SiteChanged,
    SiteConfig,
    SiteSharing,
    internal_ip,
    lease_name,
    peer_of,
)

from tests.nodeagent.origin import serve

SIZE = 1 << 20
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
# The receiver (n1) and the holder (n2): each knows the other's key, as from their Nodes.
ME, HOLDER = peerauth.Identity("n1"), peerauth.Identity("n2")


def _knows_me(node: str) -> str | None:
    return ME.public if node == "n1" else None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[PeerServer]:
    cache = ContentCache(tmp_path / "holder")
    cache.blobs.mkdir(parents=True)
    cache.path(SHA).write_bytes(DATA)
    server = PeerServer(cache, HOLDER, _knows_me, "127.0.0.1", 0)
    server.start()
    yield server
    server.close()


def _obtain(
    tmp_path: Path, peers: dict[str, Peer], url: str, wait: float
) -> tuple[str, float, ContentCache]:
    """One obtain() by an agent whose API server does not answer."""
    cache = ContentCache(tmp_path / "receiver")
    token = tmp_path / "token"
    token.write_text("t")
    endpoint = Endpoint(f"https://127.0.0.1:{_closed_port()}", token, None)

    async def go() -> tuple[str, float]:
        reader = KubeClient(endpoint, timeout=1.0)
        cfg = SiteConfig("n1", "ember", 0, lease_seconds=3, origin_wait_seconds=wait)
        with httpx.Client(timeout=10) as http:
            site = SiteSharing(cache, reader, cfg, me=ME, http=http, stop=threading.Event())
            site.view.peers = dict(peers)  # what it knew before the API went away
            want = Want(url, SHA, SIZE)

            async def origin() -> None:
                await asyncio.to_thread(cache.fetch, http, want)

            started = time.monotonic()
            where = await site.obtain(want, origin)
            elapsed = time.monotonic() - started
        await reader.aclose()
        return where, elapsed

    where, elapsed = asyncio.run(go())
    return where, elapsed, cache


def test_known_peer_serves_while_the_api_is_away(tmp_path: Path, holder: PeerServer) -> None:
    """The peer had not even advertised the file: it is asked directly (and verified with
    the key it had published before the API went away)."""
    peers = {"n2": Peer(f"127.0.0.1:{holder.port}", key=HOLDER.public)}
    with serve({"m": DATA}) as (base, origin):
        where, _, cache = _obtain(tmp_path, peers, f"{base}/m", wait=60)
    assert where == "peer" and cache.path(SHA).read_bytes() == DATA
    assert origin.bytes_sent == 0 and holder.bytes_served == SIZE


def test_a_known_peer_that_gets_the_file_later_is_asked_again(tmp_path: Path) -> None:
    """Partitioned, the holder still downloading: its 404s do not shun it, so the file comes
    from it a poll after it lands, not after a 30 s penalty, and never from the origin."""
    cache = ContentCache(tmp_path / "late-holder")
    cache.blobs.mkdir(parents=True)
    server = PeerServer(cache, HOLDER, _knows_me, "127.0.0.1", 0)
    server.start()
    timer = threading.Timer(1.5, lambda: cache.path(SHA).write_bytes(DATA))
    timer.start()
    try:
        peers = {"n2": Peer(f"127.0.0.1:{server.port}", key=HOLDER.public)}
        with serve({"m": DATA}) as (base, origin):
            where, elapsed, _ = _obtain(tmp_path, peers, f"{base}/m", wait=60)
    finally:
        timer.join()
        server.close()
    assert where == "peer" and origin.bytes_sent == 0
    assert elapsed < 10, elapsed


def test_origin_only_after_the_bounded_wait(tmp_path: Path) -> None:
    dead_peer = {"n2": Peer(f"127.0.0.1:{_closed_port()}", key=HOLDER.public)}
    with serve({"m": DATA}) as (base, origin):
        where, elapsed, cache = _obtain(tmp_path, dead_peer, f"{base}/m", wait=2.0)
    assert where == "origin" and cache.path(SHA).read_bytes() == DATA
    assert elapsed >= 2.0, elapsed
    assert origin.bytes_sent == SIZE


def test_lease_names_are_dns_names_whatever_the_site_label() -> None:
    sha = "ab" * 32
    assert lease_name("edge-lab", sha) == f"ember-fetch-edge-lab-{'ab' * 8}"
    assert lease_name("Plant_7.North", sha) == f"ember-fetch-plant-7-north-{'ab' * 8}"
    assert lease_name("...", sha) == f"ember-fetch-site-{'ab' * 8}"


def test_a_nodes_peer_annotations_are_read_back() -> None:
    node = {
        "metadata": {
            "annotations": {
                "ember.dev/peer": "10.0.0.5:7431",
                "ember.dev/cache": "a1,b2,",
                "ember.dev/peer-key": HOLDER.public,
            }
        },
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "n"},
                {"type": "InternalIP", "address": "10.0.0.5"},
            ]
        },
    }
    assert peer_of(node) == Peer("10.0.0.5:7431", frozenset({"a1", "b2"}), HOLDER.public)
    assert internal_ip(node) == "10.0.0.5"
    assert peer_of({"metadata": {}}) is None and internal_ip({}) is None


def test_own_node_leaving_its_site_makes_the_agent_read_it_again(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    reader = KubeClient(Endpoint("https://127.0.0.1:9", token, None))
    cfg = SiteConfig("n1", "ember", 0)
    with httpx.Client() as http:
        site = SiteSharing(
            ContentCache(tmp_path), reader, cfg, me=ME, http=http, stop=threading.Event()
        )
        site.view.site, site.view.resolved = "a", True

        def node(name: str, site_label: str) -> dict[str, object]:
            annotations = {"ember.dev/peer": "10.0.0.2:7431", "ember.dev/cache": "ab"}
            labels = {"ember.dev/site": site_label}
            return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}

        site._apply_node("ADDED", node("n2", "a"))
        site._apply_node("MODIFIED", node("n1", "a"))  # ourselves, unchanged: nothing
        assert site.view.resolved and list(site.view.peers) == ["n2"]
        with pytest.raises(SiteChanged):
            site._apply_node("MODIFIED", node("n1", "b"))
        assert not site.view.resolved
    asyncio.run(reader.aclose())
