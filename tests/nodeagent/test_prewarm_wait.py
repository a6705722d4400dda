"""Prewarm on an http source: it waits for the node agent's cache, reports the agent's recorded
failure as its own reason, and gives up with ModelDownloading after `model_wait_seconds`; the
agent's fetcher fills the cache from the pods it is shown. No cluster: the real cache, a real
origin, real files; the InferenceDeployments' specs come from a dict (`_Specs`) rather than the
API server (tests/nodeagent/test_fetch_trust_cluster.py reads them from the real one). Prewarm
reads the agent's per-digest views (nodeagent/views.py), which a thread keeps in step with the
cache here as the agent's loop does."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL
from ember_runtime.contract.config import ModelFetch, ModelFile, RuntimeConfig
from ember_runtime.contract.download import Observation, progress_message
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent.cache import ContentCache, FetchError
from ember_runtime.nodeagent.fetcher import Claim, Fetcher
from ember_runtime.nodeagent.views import DigestViews
from ember_runtime.prewarm import cachewait
from ember_runtime.prewarm.cachewait import wait_for_cache
from ember_runtime.prewarm.errors import PrewarmError

from tests.nodeagent.origin import serve

DATA = os.urandom(300_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture(autouse=True)
def views(tmp_path: Path) -> Iterator[None]:
    """The agent's view sync, every 10 ms, for SHA in the caches these tests use."""
    synced = [
        DigestViews(ContentCache(root), lambda: [SHA]) for root in (tmp_path, tmp_path / "cache")
    ]
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.01):
            for v in synced:
                v.sync()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def _config(root: Path, sha: str = SHA, wait: float = 5.0) -> RuntimeConfig:
    return RuntimeConfig(
        model_name="m",
        model_dir=str(root / "views"),
        model_layout="sha256",
        model_wait_seconds=wait,
        files=[ModelFile(path="m.gguf", sha256=sha, size_bytes=len(DATA))],
    )


def test_waits_until_the_agent_has_placed_the_file(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)

    def place() -> None:
        cache.partial(SHA).write_bytes(DATA)
        cache.partial(SHA).rename(cache.path(SHA))

    timer = threading.Timer(0.5, place)
    timer.start()
    out = io.StringIO()
    wait_for_cache(_config(tmp_path), out, threading.Event(), interval_s=0.05)
    timer.join()
    assert cache.path(SHA).exists()
    assert "waiting for the node agent: 0 of 300000 bytes" in out.getvalue()


def test_recorded_checksum_mismatch_is_prewarms_reason(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    cache.record_failure(SHA, FetchError("h/m.gguf expected a… got b…", reasons.CHECKSUM_MISMATCH))
    with pytest.raises(PrewarmError) as info:
        wait_for_cache(_config(tmp_path), io.StringIO(), threading.Event(), interval_s=0.05)
    assert info.value.reason == reasons.CHECKSUM_MISMATCH
    assert str(info.value) == "m.gguf: h/m.gguf expected a… got b…"


def test_gives_up_with_model_downloading_node_bytes_and_no_eta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No byte arrived during the wait: the message says so instead of inventing an ETA. The
    node's name comes from the env the operator renders (the downward API's spec.nodeName)."""
    monkeypatch.setenv(cachewait.NODE_ENV, "node-a")
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[:1000])
    DigestViews(cache, lambda: [SHA]).sync()  # the view shows it before prewarm looks
    with pytest.raises(PrewarmError) as info:
        wait_for_cache(_config(tmp_path, wait=0.3), io.StringIO(), threading.Event(), 0.05)
    assert info.value.reason == reasons.MODEL_DOWNLOADING
    assert (
        str(info.value)
        == "node-a: 1.0 of 300.0 kB in the node cache, ETA unknown (no progress in 0s)"
    )


def test_eta_comes_from_the_bytes_seen_growing_during_the_wait(tmp_path: Path) -> None:
    """The agent's partial grows while prewarm waits (100 kB in ~0.4 s): the message has a
    rate and a finite ETA, and is one line the operator can show per node."""
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[:100_000])
    DigestViews(cache, lambda: [SHA]).sync()
    grow = threading.Timer(0.2, lambda: cache.partial(SHA).write_bytes(DATA[:200_000]))
    grow.start()
    with pytest.raises(PrewarmError) as info:
        wait_for_cache(_config(tmp_path, wait=0.6), io.StringIO(), threading.Event(), 0.05, "n-1")
    grow.join()
    text = str(info.value)
    assert text.startswith("n-1: 200.0 of 300.0 kB in the node cache, ETA "), text
    assert "ETA unknown" not in text and "B/s over " in text, text


@pytest.mark.parametrize(
    ("done", "elapsed", "expected"),
    [
        (1_000_000_000, 10.0, "1.0 of 3.4 GB in the node cache, ETA 24s (100.0 MB/s over 10s)"),
        (1_200_000_000, 100.0, "1.2 of 3.4 GB in the node cache, ETA 3m03s (12.0 MB/s over 1m40s)"),
        (3_000_000, 60.0, "0.0 of 3.4 GB in the node cache, ETA 18h52m (50.0 kB/s over 1m00s)"),
        (0, 60.0, "0.0 of 3.4 GB in the node cache, ETA unknown (no progress in 1m00s)"),
    ],
)
def test_progress_message(done: int, elapsed: float, expected: str) -> None:
    first, last = Observation(5.0, 0), Observation(5.0 + elapsed, done)
    assert progress_message("a", first, last, 3_400_000_000) == f"a: {expected}"


def _pod(uid: str, base: str, sha: str) -> dict[str, Any]:
    """A pod of InferenceDeployment `sha[:8]` whose spec (in `_Specs`) wants `base`/m.gguf."""
    fetch = {"files": [{"url": f"{base}/m.gguf", "sha256": sha, "sizeBytes": len(DATA)}]}
    _Specs.specs[sha[:8]] = ModelFetch.model_validate(fetch)
    meta = {
        "uid": uid,
        "name": uid,
        "namespace": "t",
        "labels": {INSTANCE_LABEL: sha[:8]},
        "annotations": {FETCH_HASH_ANNOTATION: "v1"},
    }
    return {"metadata": meta}


class _Specs:
    specs: ClassVar[dict[str, ModelFetch]] = {}

    async def resolve(self, claim: Claim) -> ModelFetch | None:
        return self.specs.get(claim.name)


async def _fetch_for(cache: ContentCache, pods: list[dict[str, Any]]) -> Fetcher:
    reader = KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))
    fetcher = Fetcher(cache, reader, "node-a", "ember-system", resolver=_Specs())
    for pod in pods:
        await fetcher._apply({"type": "ADDED", "object": pod})
    fetcher.reconcile()
    fetcher.reconcile()  # a second pass starts nothing twice
    assert len(fetcher._running) <= 1
    await asyncio.gather(*fetcher._running.values())
    await reader.aclose()
    return fetcher


def test_fetcher_fills_the_cache_once_for_the_pods_that_want_it(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    with serve({"m.gguf": DATA}) as (base, origin):
        pods = [_pod("a", base, SHA), _pod("b", base, SHA), {"metadata": {"uid": "c"}}]
        asyncio.run(_fetch_for(cache, pods))
    assert cache.path(SHA).read_bytes() == DATA
    assert origin.bytes_sent == len(DATA)  # two pods, one download


def test_fetcher_records_a_mismatch_and_does_not_retry_it_at_once(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    wrong = hashlib.sha256(b"other").hexdigest()
    with serve({"m.gguf": DATA}) as (base, origin):
        fetcher = asyncio.run(_fetch_for(cache, [_pod("a", base, wrong)]))
        line = cache.failure(wrong)
        assert line is not None and line.startswith("ChecksumMismatch: ")
        assert not cache.path(wrong).exists() and not cache.partial(wrong).exists()

        async def again() -> None:
            fetcher.reconcile()
            assert not fetcher._running  # a wrong sha256 is not fetched again

        asyncio.run(again())
        assert len(origin.requests) == 1
        asyncio.run(fetcher._apply({"type": "DELETED", "object": _pod("a", base, wrong)}))
        fetcher.reconcile()  # nobody wants it any more: the record goes
    assert cache.failure(wrong) is None
