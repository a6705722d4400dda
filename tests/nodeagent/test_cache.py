"""The content-addressed cache against a real HTTP origin (tests/nodeagent/origin.py): full
fetch, resume after a cut connection, checksum and size mismatches, and credentials from a
Secret's data. No cluster."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.cache import cache_label
from ember_runtime.kube import ApiError
from ember_runtime.nodeagent import labels as labels_module
from ember_runtime.nodeagent.cache import Busy, ContentCache, FetchError, Want, _locked_partial
from ember_runtime.nodeagent.credentials import auth_headers, decode_secret_data
from ember_runtime.nodeagent.labels import CacheLabels, label_patch
from ember_runtime.nodeagent.site import short

from tests.nodeagent.origin import serve

SIZE = 3 * (1 << 20) + 12345  # a few MB, not a multiple of any chunk size
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


def _entries(cache: ContentCache) -> list[str]:
    return sorted(p.name for p in cache.blobs.iterdir()) if cache.blobs.exists() else []


@pytest.fixture
def cache(tmp_path: Path) -> ContentCache:
    return ContentCache(tmp_path / "cache")


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def test_full_fetch_lands_verified_under_its_digest(
    cache: ContentCache, client: httpx.Client
) -> None:
    with serve({"m.gguf": DATA}) as (base, origin):
        path = cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
    assert path == cache.blobs / SHA and path.read_bytes() == DATA
    assert _entries(cache) == [SHA]  # no partial left behind
    assert path.stat().st_mode & 0o777 == 0o644  # prewarm (another uid) reads it
    assert origin.bytes_sent == SIZE and "range" not in origin.requests[0]


def test_a_held_file_is_not_fetched_again(cache: ContentCache, client: httpx.Client) -> None:
    with serve({"m.gguf": DATA}) as (base, origin):
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
    assert len(origin.requests) == 1


def test_cut_connection_resumes_where_it_stopped(cache: ContentCache, client: httpx.Client) -> None:
    cut = SIZE // 3
    seen: list[int] = []
    with serve({"m.gguf": DATA}) as (base, origin):
        origin.cut_after = cut
        path = cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE), progress=seen.append)
    assert path.read_bytes() == DATA
    assert len(origin.requests) == 2, origin.requests
    resumed_from = int(origin.requests[1]["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_from <= cut
    assert origin.bytes_sent <= 1.05 * SIZE, origin.bytes_sent
    assert seen[-1] == SIZE


def test_partial_from_an_earlier_run_is_rehashed_and_resumed(
    cache: ContentCache, client: httpx.Client
) -> None:
    """A killed agent leaves `.partial`; the next one sends only the rest."""
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[: SIZE // 2])
    with serve({"m.gguf": DATA}) as (base, origin):
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
    assert origin.requests[0]["range"] == f"bytes={SIZE // 2}-"
    assert origin.bytes_sent == SIZE - SIZE // 2
    assert cache.path(SHA).read_bytes() == DATA


def test_corrupt_partial_is_caught_by_the_digest_and_fetched_again_whole(
    cache: ContentCache, client: httpx.Client
) -> None:
    """Bytes on disk are not trusted: a flipped byte in the partial fails the resumed file,
    which is then fetched once more from the first byte (a mismatch is reported only for a
    file downloaded whole from the URL: issue 34, hole 2)."""
    cache.blobs.mkdir(parents=True)
    bad = bytearray(DATA[: SIZE // 2])
    bad[10] ^= 0xFF
    cache.partial(SHA).write_bytes(bad)
    with serve({"m.gguf": DATA}) as (base, origin):
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
    assert cache.path(SHA).read_bytes() == DATA
    assert origin.bytes_sent == (SIZE - SIZE // 2) + SIZE
    assert _entries(cache) == [SHA]


def test_a_whole_file_that_hashes_wrong_is_a_checksum_mismatch(
    cache: ContentCache, client: httpx.Client
) -> None:
    wrong = hashlib.sha256(b"x").hexdigest()
    with serve({"m.gguf": DATA}) as (base, origin), pytest.raises(FetchError) as info:
        cache.fetch(client, Want(f"{base}/m.gguf", wrong, SIZE))
    assert info.value.reason == reasons.CHECKSUM_MISMATCH
    assert origin.bytes_sent == SIZE  # fetched once: nothing was resumed
    assert _entries(cache) == []


def test_origin_ignoring_range_restarts_from_zero(
    cache: ContentCache, client: httpx.Client
) -> None:
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[:1000])
    with serve({"m.gguf": DATA}) as (base, origin):
        origin.ignore_range = True
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE))
    assert cache.path(SHA).read_bytes() == DATA


def test_wrong_sha256_is_checksum_mismatch_and_nothing_cached(
    cache: ContentCache, client: httpx.Client
) -> None:
    wrong = hashlib.sha256(b"another model").hexdigest()
    with serve({"m.gguf": DATA}) as (base, _), pytest.raises(FetchError) as info:
        cache.fetch(client, Want(f"{base}/m.gguf", wrong, SIZE))
    assert info.value.reason == reasons.CHECKSUM_MISMATCH
    assert f"expected {wrong[:12]}… got {SHA[:12]}…" in str(info.value)
    assert _entries(cache) == []
    cache.record_failure(wrong, info.value)
    assert cache.failure(wrong) == reasons.termination_message(
        reasons.CHECKSUM_MISMATCH, str(info.value)
    )


def test_longer_file_is_size_mismatch_and_nothing_cached(
    cache: ContentCache, client: httpx.Client
) -> None:
    with serve({"m.gguf": DATA}) as (base, _), pytest.raises(FetchError) as info:
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE - 1))
    assert info.value.reason == reasons.SIZE_MISMATCH
    assert _entries(cache) == []


def test_http_error_names_the_status_and_leaves_nothing(
    cache: ContentCache, client: httpx.Client
) -> None:
    with serve({}) as (base, _), pytest.raises(FetchError) as info:
        cache.fetch(client, Want(f"{base}/gone.gguf?sig=secret", SHA, SIZE))
    assert info.value.reason == reasons.MODEL_DOWNLOAD_FAILED
    assert "HTTP 404" in str(info.value) and "secret" not in str(info.value)
    assert _entries(cache) == []


def test_same_digest_fetched_once_at_a_time(cache: ContentCache, client: httpx.Client) -> None:
    cache.blobs.mkdir(parents=True)
    with _locked_partial(cache.partial(SHA)), pytest.raises(Busy):
        cache.fetch(client, Want("http://127.0.0.1:9/m", SHA, SIZE))


def test_stop_interrupts_and_keeps_the_partial(cache: ContentCache, client: httpx.Client) -> None:
    stop = threading.Event()

    def halt(done: int) -> None:
        if done >= SIZE // 2:
            stop.set()

    with serve({"m.gguf": DATA}) as (base, _), pytest.raises(InterruptedError):
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE), stop=stop, progress=halt)
    assert not cache.path(SHA).exists()
    assert 0 < cache.partial(SHA).stat().st_size < SIZE  # kept for the next run to resume


def _b64(**values: str) -> dict[str, str]:
    return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}


def test_bearer_token_from_the_secret_reaches_the_origin(
    cache: ContentCache, client: httpx.Client
) -> None:
    with serve({"m.gguf": DATA}) as (base, origin):
        data = decode_secret_data(_b64(token="s3cret", urlPrefix=base))
        url = f"{base}/m.gguf"
        cache.fetch(client, Want(url, SHA, SIZE, headers=auth_headers("hf", data, url)))
    assert origin.requests[0]["authorization"] == "Bearer s3cret"


def test_basic_auth_from_the_secret() -> None:
    data = {"username": "u", "password": "p", "urlPrefix": "https://models.example"}
    headers = auth_headers("hf", data, "https://models.example/m.gguf")
    assert headers == {"Authorization": "Basic " + base64.b64encode(b"u:p").decode()}


@pytest.mark.parametrize(
    ("prefix", "url"),
    [
        ("", "https://models.example/m.gguf"),
        ("https://models.example", "https://models.example.evil/m.gguf"),
        ("https://models.example/org", "https://models.example/org-evil/m.gguf"),
        ("https://models.example/", "http://models.example/m.gguf"),
    ],
)
def test_credentials_go_only_under_the_secrets_url_prefix(prefix: str, url: str) -> None:
    with pytest.raises(FetchError, match="urlPrefix"):
        auth_headers("hf", {"token": "t", "urlPrefix": prefix}, url)


def test_interrupted_before_any_byte_leaves_no_partial(
    cache: ContentCache, client: httpx.Client
) -> None:
    """The partial doubles as the download's lock file: an empty one is not kept."""
    stop = threading.Event()
    stop.set()
    with serve({"m.gguf": DATA}) as (base, _), pytest.raises(InterruptedError):
        cache.fetch(client, Want(f"{base}/m.gguf", SHA, SIZE), stop=stop)
    assert _entries(cache) == []


def test_cache_label_patch_sets_new_digests_and_deletes_gone_ones(tmp_path: Path) -> None:
    """The agent's Node labels follow the cache: a complete file gets its label, a partial or
    a stray name none, and a label whose file is gone is deleted (null in the merge patch)."""
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)
    held, gone = "ab" * 32, "cd" * 32
    cache.path(held).write_bytes(b"x")
    cache.partial("ef" * 32).write_bytes(b"half")
    (cache.blobs / "stray").write_bytes(b"?")
    labels = CacheLabels(cache, api=None, node="n")  # type: ignore[arg-type] # no API call here
    desired = labels.desired()
    assert desired == {f"cache.ember.dev/{held[:16]}": "true"}
    assert cache_label(held) == f"cache.ember.dev/{short(held)}"  # the annotations' digest
    current = {f"cache.ember.dev/{gone[:16]}": "true", f"cache.ember.dev/{held[:16]}": "true"}
    assert label_patch(current, desired) == {f"cache.ember.dev/{gone[:16]}": None}
    assert label_patch({}, desired) == desired
    assert label_patch(desired, desired) == {}  # nothing changed: no write


class _RefusingApi:
    """A Node API that answers every label write with `status`."""

    def __init__(self, status: int) -> None:
        self.status, self.sends = status, 0

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return {"metadata": {"labels": {}}}

    async def send(
        self, method: str, path: str, body: dict[str, Any], content_type: str = ""
    ) -> dict[str, Any]:
        self.sends += 1
        raise ApiError(self.status, "no")


@pytest.mark.parametrize(("status", "at_least", "at_most"), [(403, 1, 1), (500, 5, 1000)])
def test_a_refused_label_write_waits_for_the_resync_a_transient_one_retries_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int, at_least: int, at_most: int
) -> None:
    """A 403 (RBAC, or the own-node policy) is an answer, not an outage: retrying it every few
    seconds would be two requests per node forever. A 500 is retried at the short pace."""
    monkeypatch.setattr(labels_module, "RETRY_SECONDS", 0.01)
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)
    cache.path("ab" * 32).write_bytes(b"x")
    api = _RefusingApi(status)
    labels = CacheLabels(cache, api=api, node="n", resync_seconds=60)  # type: ignore[arg-type]

    async def run_briefly() -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(labels.run(), 0.5)

    asyncio.run(run_briefly())
    assert at_least <= api.sends <= at_most, api.sends
