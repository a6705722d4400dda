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
from typing import Any

import pytest
from ember_runtime.contract.config import ModelFetch, fetch_from_spec
from ember_runtime.contract.rollout import stage_annotation
from ember_runtime.kube import ApiError, Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import Claim, Fetcher, SpecResolver
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


class Stored(SpecResolver):
    """The real resolver's choice, over one stored object (no API server to read it from)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.obj


def _model(sha: str, size: int, url: str) -> dict[str, Any]:
    return {
        "name": "m",
        "source": {"http": {"urls": {"m.gguf": url}}},
        "files": [{"path": "m.gguf", "sha256": sha, "sizeBytes": size}],
    }


async def test_a_pod_of_the_previous_version_is_given_the_previous_files() -> None:
    """Mid-rollout the object's spec is the next version while pods of sites not reached yet
    (or rolled back) run the previous one: each pod gets the files of the version it names
    (its fetch hash), the previous one's from status.rollout.stableSpec, never the next one's
    (its prewarm would wait for files that never come, and the site would fetch ahead of its
    wave)."""
    v1, v2 = _model(SHA, len(DATA), "https://o/v1"), _model(NEW_SHA, len(NEW), "https://o/v2")
    obj = {"spec": {"model": v2}, "status": {"rollout": {"stableSpec": {"model": v1}}}}
    resolver = Stored(obj)
    old, new = fetch_from_spec(v1), fetch_from_spec(v2)
    assert old is not None and new is not None

    async def files(version: str) -> list[str]:
        got = await resolver.resolve(Claim("t", "a", version))
        return [f.sha256 for f in got.files] if got else []

    assert await files(old.digest()) == [SHA]
    assert await files(new.digest()) == [NEW_SHA]
    assert await files("an-older-rendering") == [NEW_SHA]  # no match: the spec, as before
    del obj["status"]
    assert await files(old.digest()) == [NEW_SHA]  # no rollout kept anything
