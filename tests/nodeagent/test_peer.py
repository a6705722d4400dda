"""The peer port and its parts, no cluster: HMAC authentication (a bad, expired or missing
signature is refused), Range serving of complete files only, a peer fetch through the same
ContentCache.fetch that the origin uses (verified against the sha256), and the token bucket."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ember_runtime import reasons
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, FetchError, Want
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.ratelimit import TokenBucket

from tests.nodeagent.origin import serve

SIZE = 2 * (1 << 20) + 777
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
KEY = b"k" * 32


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[str, PeerServer]]:
    """A peer holding DATA under its digest; yields (base URL, server)."""
    cache = ContentCache(tmp_path / "holder")
    cache.blobs.mkdir(parents=True)
    cache.path(SHA).write_bytes(DATA)
    cache.partial("0" * 64).write_bytes(b"half a file")
    (tmp_path / "key").write_bytes(KEY + b"\n")
    server = PeerServer(cache, peerauth.PeerKey(tmp_path / "key"), "127.0.0.1", 0)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", server
    finally:
        server.close()


def _get(base: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers=headers or {}, timeout=10)


def test_signature_round_trip_and_refusals() -> None:
    now = 1_800_000_000.0
    headers = {k.lower(): v for k, v in peerauth.sign(KEY, "GET", "/sha256/x", lambda: now).items()}
    assert peerauth.verify(KEY, "GET", "/sha256/x", headers, now=lambda: now + 10) is None
    assert peerauth.verify(b"another key....", "GET", "/sha256/x", headers, now=lambda: now) == (
        "bad signature"
    )
    assert peerauth.verify(KEY, "GET", "/sha256/y", headers, now=lambda: now) == "bad signature"
    assert peerauth.verify(KEY, "HEAD", "/sha256/x", headers, now=lambda: now) == "bad signature"
    late = peerauth.verify(KEY, "GET", "/sha256/x", headers, max_skew=60, now=lambda: now + 61)
    assert late is not None and "more than 60s" in late
    early = peerauth.verify(KEY, "GET", "/sha256/x", headers, max_skew=60, now=lambda: now - 61)
    assert early is not None  # a clock ahead of ours is bounded too
    assert peerauth.verify(KEY, "GET", "/sha256/x", {}, now=lambda: now) == "no peer signature"


def test_short_key_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(b"short")
    with pytest.raises(ValueError, match="shorter than 16"):
        peerauth.PeerKey(tmp_path / "key").get()


def test_unsigned_badly_signed_and_expired_requests_get_403(
    holder: tuple[str, PeerServer],
) -> None:
    base, server = holder
    path = f"/sha256/{SHA}"
    assert _get(base, path).status_code == 403
    assert _get(base, path, peerauth.sign(b"x" * 32, "GET", path)).status_code == 403
    stale = peerauth.sign(KEY, "GET", path, lambda: time.time() - 3600)
    assert _get(base, path, stale).status_code == 403
    # A signature for one file does not open another.
    other = f"/sha256/{'1' * 64}"
    assert _get(base, other, peerauth.sign(KEY, "GET", path)).status_code == 403
    assert server.bytes_served == 0


def test_serves_whole_file_and_ranges(holder: tuple[str, PeerServer]) -> None:
    base, server = holder
    path = f"/sha256/{SHA}"
    whole = _get(base, path, peerauth.sign(KEY, "GET", path))
    assert whole.status_code == 200 and whole.content == DATA
    part = _get(base, path, {**peerauth.sign(KEY, "GET", path), "Range": "bytes=1000-"})
    assert part.status_code == 206 and part.content == DATA[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{SIZE - 1}/{SIZE}"
    mid = _get(base, path, {**peerauth.sign(KEY, "GET", path), "Range": "bytes=10-19"})
    assert mid.status_code == 206 and mid.content == DATA[10:20]
    past = _get(base, path, {**peerauth.sign(KEY, "GET", path), "Range": f"bytes={SIZE}-"})
    assert past.status_code == 416
    assert server.bytes_served == SIZE + (SIZE - 1000) + 10


def test_partials_and_unknown_digests_are_not_served(holder: tuple[str, PeerServer]) -> None:
    base, _ = holder
    for path in (f"/sha256/{'0' * 64}", f"/sha256/{'0' * 64}.partial", "/etc/passwd"):
        assert _get(base, path, peerauth.sign(KEY, "GET", path)).status_code == 404
    post = httpx.post(f"{base}/sha256/{SHA}", headers=peerauth.sign(KEY, "POST", "/x"))
    assert post.status_code == 405  # read-only, whoever asks


def _signer(method: str, path: str) -> dict[str, str]:
    return peerauth.sign(KEY, method, path)


def test_peer_fetch_goes_through_the_verified_download(
    holder: tuple[str, PeerServer], tmp_path: Path
) -> None:
    base, _ = holder
    cache = ContentCache(tmp_path / "receiver")
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[: SIZE // 3])  # left by an interrupted transfer
    with httpx.Client(timeout=10) as client:
        cache.fetch(client, Want(f"{base}/sha256/{SHA}", SHA, SIZE, signer=_signer))
    assert cache.path(SHA).read_bytes() == DATA
    assert not cache.partial(SHA).exists()


def test_a_peer_serving_other_bytes_lands_nothing(
    holder: tuple[str, PeerServer], tmp_path: Path
) -> None:
    """The holder's file is not what the receiver's spec names: the digest catches it."""
    base, server = holder
    wrong = hashlib.sha256(b"what the spec says").hexdigest()
    server.cache.path(wrong).write_bytes(DATA)  # a corrupted holder
    cache = ContentCache(tmp_path / "receiver")
    with httpx.Client(timeout=10) as client, pytest.raises(FetchError) as info:
        cache.fetch(client, Want(f"{base}/sha256/{wrong}", wrong, SIZE, signer=_signer))
    assert info.value.reason == reasons.CHECKSUM_MISMATCH
    assert cache.held() == [] and list(cache.blobs.iterdir()) == []


def test_token_bucket_holds_the_average_rate() -> None:
    clock = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    bucket = TokenBucket(1000.0, burst=500.0, clock=lambda: clock[0], sleep=sleep)
    bucket.take(500)  # the burst: no wait
    assert slept == []
    bucket.take(1000)  # 1000 more at 1000/s: one second
    assert slept == [pytest.approx(1.0)]
    clock[0] += 10.0  # idle: the bucket refills only up to the burst
    bucket.take(500)
    assert len(slept) == 1
    bucket.take(250)
    assert slept[-1] == pytest.approx(0.25)


def test_token_bucket_stop_interrupts_the_wait() -> None:
    stop = threading.Event()
    stop.set()
    bucket = TokenBucket(10.0, burst=10.0)
    with pytest.raises(InterruptedError):
        bucket.take(1000, stop)


def test_limited_origin_download_takes_as_long_as_the_rate_says(tmp_path: Path) -> None:
    rate = 4 << 20  # 4 MiB/s, a burst of 1 MiB: ~0.3 s for the 2 MiB file
    cache = ContentCache(tmp_path / "c")
    started = time.monotonic()
    with serve({"m": DATA}) as (base, _), httpx.Client(timeout=10) as client:
        cache.fetch(client, Want(f"{base}/m", SHA, SIZE), limiter=TokenBucket(rate))
    elapsed = time.monotonic() - started
    assert elapsed >= (SIZE - (1 << 20)) / rate * 0.9, elapsed
    assert cache.path(SHA).read_bytes() == DATA


def test_a_slow_reader_gets_the_whole_file(tmp_path: Path) -> None:
    """The send buffer fills while the peer pauses; the server waits instead of failing."""
    big = os.urandom(24 << 20)
    sha = hashlib.sha256(big).hexdigest()
    cache = ContentCache(tmp_path / "holder")
    cache.blobs.mkdir(parents=True)
    cache.path(sha).write_bytes(big)
    (tmp_path / "key").write_bytes(KEY)
    server = PeerServer(cache, peerauth.PeerKey(tmp_path / "key"), "127.0.0.1", 0)
    server.start()
    try:
        path = f"/sha256/{sha}"
        url = f"http://127.0.0.1:{server.port}{path}"
        got = bytearray()
        with httpx.stream("GET", url, headers=peerauth.sign(KEY, "GET", path), timeout=30) as r:
            for i, chunk in enumerate(r.iter_bytes(1 << 20)):
                if i == 0:
                    time.sleep(1.0)
                got += chunk
    finally:
        server.close()
    assert hashlib.sha256(got).hexdigest() == sha
