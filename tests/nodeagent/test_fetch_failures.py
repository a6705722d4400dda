"""The fetcher's failures are per (digest, URL), expire, and are retried (issue 34, holes 2 and
3). The real Fetcher and cache against a real origin; the InferenceDeployments' specs come from
a dict (tests/nodeagent/test_fetch_trust_cluster.py reads them from the real API server). No
cluster."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL
from ember_runtime.contract.config import ModelFetch
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import Claim, Fetcher

from tests.nodeagent.origin import serve

DATA = os.urandom(200_000)
SHA = hashlib.sha256(DATA).hexdigest()


class Specs:
    def __init__(self) -> None:
        self.specs: dict[str, ModelFetch] = {}

    async def resolve(self, claim: Claim) -> ModelFetch | None:
        return self.specs.get(claim.name)


def pod(uid: str, name: str) -> dict[str, Any]:
    labels = {INSTANCE_LABEL: name}
    meta = {"uid": uid, "namespace": "t", "labels": labels}
    return {"metadata": {**meta, "annotations": {FETCH_HASH_ANNOTATION: "v1"}}}


def fetch(url: str) -> ModelFetch:
    files = [{"url": url, "sha256": SHA, "sizeBytes": len(DATA)}]
    return ModelFetch.model_validate({"files": files})


async def settle(fetcher: Fetcher) -> None:
    fetcher.reconcile()
    while fetcher._running:
        await asyncio.gather(*list(fetcher._running.values()))


def test_a_mismatch_is_retried_after_its_wait_and_the_record_goes(tmp_path: Path) -> None:
    """The bytes at the URL were wrong, then fixed: the URL is tried again after
    mismatch_retry_seconds (not never), and the node's failure record goes once it succeeds."""
    cache = ContentCache(tmp_path)
    specs = Specs()
    with serve({"m.gguf": os.urandom(len(DATA))}) as (base, origin):
        specs.specs["m"] = fetch(f"{base}/m.gguf")

        async def run() -> None:
            reader = KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))
            fetcher = Fetcher(cache, reader, "n", "ns", resolver=specs, mismatch_retry_seconds=0.5)
            await fetcher._apply({"type": "ADDED", "object": pod("p", "m")})
            await settle(fetcher)
            line = cache.failure(SHA)
            assert line is not None and line.startswith(reasons.CHECKSUM_MISMATCH)
            origin.files["m.gguf"] = DATA  # the origin is fixed
            await settle(fetcher)
            assert len(origin.paths) == 1  # not before its wait
            time.sleep(0.6)
            await settle(fetcher)
            await reader.aclose()

        asyncio.run(run())
    assert len(origin.paths) == 2
    assert cache.path(SHA).read_bytes() == DATA
    assert cache.failure(SHA) is None


def test_each_url_keeps_its_own_failure(tmp_path: Path) -> None:
    """Two objects want one digest: the wrong URL fails alone (no record while the other URL
    is untried), the right URL fills the cache, and the wrong one is not tried again."""
    cache = ContentCache(tmp_path)
    specs = Specs()
    with serve({"wrong": os.urandom(len(DATA)), "right": DATA}) as (base, origin):
        specs.specs["a"] = fetch(f"{base}/wrong")
        specs.specs["b"] = fetch(f"{base}/right")

        async def run() -> None:
            reader = KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))
            fetcher = Fetcher(cache, reader, "n", "ns", resolver=specs)
            await fetcher._apply({"type": "ADDED", "object": pod("pa", "a")})
            await fetcher._apply({"type": "ADDED", "object": pod("pb", "b")})
            await settle(fetcher)
            await reader.aclose()

        asyncio.run(run())
    assert origin.paths == ["/wrong", "/right"]
    assert cache.path(SHA).read_bytes() == DATA
    assert cache.failure(SHA) is None
