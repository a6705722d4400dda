"""The agent's /metrics after real transfers, no cluster: a file from the test origin through
the Fetcher, the same file from a peer (a real PeerServer with its own metrics, as on another
node) through SiteSharing's peer path. Each side's endpoint is read over HTTP and parsed as
Prometheus text; the counts are the bytes that crossed each link, under a fixed label set."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import httpx
from ember_runtime.contract.config import FetchFile
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, Want
from ember_runtime.nodeagent.fetcher import Fetcher, Wanted
from ember_runtime.nodeagent.metrics import AgentMetrics
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.site import Peer, SiteConfig, SiteSharing, short
from prometheus_client.parser import text_string_to_metric_families

from tests.nodeagent.origin import serve

SIZE = 3 * (1 << 20) + 5
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _reader() -> KubeClient:
    return KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))


def test_origin_and_peer_bytes_on_the_real_endpoint(tmp_path: Path) -> None:
    first, second = AgentMetrics(), AgentMetrics()  # two nodes
    first_port, second_port = first.serve("127.0.0.1", 0), second.serve("127.0.0.1", 0)
    me, them = peerauth.Identity("second"), peerauth.Identity("first")
    holder = ContentCache(tmp_path / "first")
    knows = {"second": me.public}.get
    server = PeerServer(holder, them, knows, "127.0.0.1", 0, metrics=first)
    server.start()
    try:
        with serve({"m.gguf": DATA}) as (base, origin):

            async def from_origin() -> None:
                reader = _reader()
                fetcher = Fetcher(holder, reader, "first", "ns", metrics=first)
                file = FetchFile(url=f"{base}/m.gguf", sha256=SHA, size_bytes=SIZE)
                await fetcher._fetch(Wanted(file, None))
                await reader.aclose()

            asyncio.run(from_origin())
            assert origin.bytes_sent == SIZE
        assert holder.has(SHA, SIZE)

        async def from_peer() -> bool:
            reader = _reader()
            cfg = SiteConfig(node="second", namespace="ns", peer_port=0)
            with httpx.Client(timeout=10) as http:
                site = SiteSharing(
                    ContentCache(tmp_path / "second"),
                    reader,
                    cfg,
                    me=me,
                    http=http,
                    stop=threading.Event(),
                    metrics=second,
                )
                site.view.peers = {
                    "first": Peer(f"127.0.0.1:{server.port}", frozenset({short(SHA)}), them.public)
                }
                got = await site._from_peers(Want("unused", SHA, SIZE))
            await reader.aclose()
            return got

        assert asyncio.run(from_peer())
    finally:
        server.close()
    one, two = scrape(first_port), scrape(second_port)
    first.close()
    second.close()
    fetched = "ember_nodeagent_fetched_bytes_total"
    files = "ember_nodeagent_fetched_files_total"
    served = "ember_nodeagent_peer_served_bytes_total"
    assert one[(fetched, (("source", "origin"),))] == SIZE
    assert one[(fetched, (("source", "peer"),))] == 0
    assert one[(files, (("source", "origin"),))] == 1
    assert one[(served, ())] == SIZE
    assert two[(fetched, (("source", "peer"),))] == SIZE
    assert two[(fetched, (("source", "origin"),))] == 0
    assert two[(files, (("source", "peer"),))] == 1
    assert two[(served, ())] == 0
    # A fixed label set: no digest, URL or address ever becomes a series.
    ours = {k for k in one if k[0].startswith("ember_nodeagent_")}
    assert {labels for _, labels in ours} <= {(), (("source", "origin"),), (("source", "peer"),)}
