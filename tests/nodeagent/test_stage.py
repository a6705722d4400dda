"""A rollout's stage requests in the fetcher: picked up like a pod's claim, dropped when they go,
read again when the object could not be read or may have changed. The real Fetcher and cache
against a real origin; the InferenceDeployments' specs come from a dict, as in
test_fetch_failures.py (test_stage_cluster.py reads them, and the Node's annotations, from the
real API server). No cluster."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from ember_runtime.contract.config import ModelFetch
from ember_runtime.contract.rollout import stage_annotation
from ember_runtime.kube import ApiError, Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import Claim, Fetcher
from ember_runtime.nodeagent.metrics import AgentMetrics
from ember_runtime.nodeagent.stage import requests_of

from tests.nodeagent.origin import serve

DATA = os.urandom(150_000)
SHA = hashlib.sha256(DATA).hexdigest()
NEW = os.urandom(120_000)
NEW_SHA = hashlib.sha256(NEW).hexdigest()


class Specs:
    """InferenceDeployments by (namespace, name); `down` makes a read fail as the API would."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str], ModelFetch] = {}
        self.down = False
        self.reads: list[Claim] = []

    async def resolve(self, claim: Claim) -> ModelFetch | None:
        self.reads.append(claim)
        if self.down:
            raise ApiError(503, "unavailable")
        return self.specs.get((claim.namespace, claim.name))


def fetch(url: str, sha: str, size: int) -> ModelFetch:
    return ModelFetch.model_validate({"files": [{"url": url, "sha256": sha, "sizeBytes": size}]})


async def settle(fetcher: Fetcher) -> None:
    fetcher.reconcile()
    while fetcher._running:
        await asyncio.gather(*list(fetcher._running.values()))


@pytest.fixture
def reader() -> KubeClient:
    """Never asked: the specs come from `Specs`, the requests from the test (each test's
    loop ends with the test, and the client with it)."""
    return KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))


def standing(metrics: AgentMetrics) -> float | None:
    return metrics.registry.get_sample_value("ember_nodeagent_stage_requests")


async def test_a_stage_request_is_fetched_with_no_pod_and_dropped_when_removed(
    tmp_path: Path, reader: KubeClient
) -> None:
    cache, specs, metrics = ContentCache(tmp_path), Specs(), AgentMetrics()
    with serve({"m.gguf": DATA}) as (base, origin):
        specs.specs[("tenant", "app")] = fetch(f"{base}/m.gguf", SHA, len(DATA))
        fetcher = Fetcher(cache, reader, "n", "ns", resolver=specs, metrics=metrics)
        await fetcher.stage({("tenant", "app")})
        await settle(fetcher)
        assert cache.path(SHA).read_bytes() == DATA
        assert set(fetcher.wanted()) == {SHA} and fetcher.pods == {}
        assert standing(metrics) == 1
        await fetcher.stage({("tenant", "app")})  # another Node event, same requests
        assert [c.name for c in specs.reads] == ["app"]  # not read again for it
        await fetcher.stage(set())
        await settle(fetcher)
    assert fetcher.wanted() == {}  # no longer wanted ...
    assert cache.has(SHA, len(DATA))  # ... but kept: the evictor decides when it goes
    assert origin.paths == ["/m.gguf"]
    assert standing(metrics) == 0
    metrics.close()


async def test_an_unreadable_object_is_read_again_and_a_changed_spec_is_fetched(
    tmp_path: Path, reader: KubeClient
) -> None:
    """The API server is away when the request comes: nothing is fetched, and the next tick
    reads it. Later the object's spec moves to another version while the request stands: it
    is read again after stage_reread_seconds and the new file fetched."""
    cache, specs = ContentCache(tmp_path), Specs()
    with serve({"m.gguf": DATA, "new.gguf": NEW}) as (base, origin):
        specs.specs[("tenant", "app")] = fetch(f"{base}/m.gguf", SHA, len(DATA))
        fetcher = Fetcher(cache, reader, "n", "ns", resolver=specs, stage_reread_seconds=3600)
        specs.down = True
        await fetcher.stage({("tenant", "app")})
        await settle(fetcher)
        assert fetcher.wanted() == {} and origin.paths == []
        specs.down = False
        await fetcher.tick()
        await settle(fetcher)
        assert cache.has(SHA, len(DATA))
        specs.specs[("tenant", "app")] = fetch(f"{base}/new.gguf", NEW_SHA, len(NEW))
        await fetcher.tick()  # not due yet: the spec read an hour ago stands
        assert set(fetcher.wanted()) == {SHA}
        fetcher.stage_reread_seconds = 0.0
        await fetcher.tick()
        await settle(fetcher)
    assert set(fetcher.wanted()) == {NEW_SHA}
    assert cache.path(NEW_SHA).read_bytes() == NEW
    assert origin.paths == ["/m.gguf", "/new.gguf"]


async def test_a_request_dropped_while_its_object_is_read_is_not_fetched(
    tmp_path: Path, reader: KubeClient
) -> None:
    """The watch's next event (the annotation gone) may land while the first read waits."""
    cache = ContentCache(tmp_path)
    gate = asyncio.Event()

    class Slow:
        async def resolve(self, claim: Claim) -> ModelFetch | None:
            await gate.wait()
            return fetch("http://127.0.0.1:9/m.gguf", SHA, len(DATA))

    fetcher = Fetcher(cache, reader, "n", "ns", resolver=Slow())
    first = asyncio.create_task(fetcher.stage({("tenant", "app")}))
    await asyncio.sleep(0)
    await fetcher.stage(set())
    gate.set()
    await first
    assert fetcher.staged == {} and fetcher.wanted() == {} and not fetcher._running


def test_only_well_formed_requests_are_read_from_a_node() -> None:
    key, value = stage_annotation("tenant", "app")
    other_key, _ = stage_annotation("tenant", "other")
    node = {
        "metadata": {
            "annotations": {
                key: value,
                other_key: value,  # a key that does not match its value
                "stage.ember.dev/0123456789abcdef": "no-slash",
                "ember.dev/cache": "tenant/app",  # not a stage request at all
            }
        }
    }
    assert requests_of(node) == {("tenant", "app")}
    assert requests_of(None) == frozenset()
