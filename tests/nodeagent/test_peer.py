"""The peer port and its parts, no cluster: per-node signatures (a bad, expired, replayed or
missing one is refused), Range serving of complete files only, a peer fetch through the same
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
from ember_runtime.contract import reasons
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, FetchError, Want
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.ratelimit import TokenBucket

from tests.nodeagent.origin import serve

SIZE = 2 * (1 << 20) + 777
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
# The holder and the asker, peers of one site (each knows the other's published key).
HOLDER, ME = peerauth.Identity("holder"), peerauth.Identity("asker")


def _site(node: str) -> str | None:
    return {"asker": ME.public, "holder": HOLDER.public}.get(node)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[str, PeerServer]]:
    """A peer holding DATA under its digest; yields (base URL, server)."""
    cache = ContentCache(tmp_path / "holder")
    cache.blobs.mkdir(parents=True)
    cache.path(SHA).write_bytes(DATA)
    cache.partial("0" * 64).write_bytes(b"half a file")
    server = PeerServer(cache, HOLDER, _site, "127.0.0.1", 0)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", server
    finally:
        server.close()


def _sign(path: str, range_: str = "", me: peerauth.Identity = ME) -> dict[str, str]:
    headers = peerauth.sign_request(me, "GET", path, "holder", range_=range_)
    return {**headers, "Range": range_} if range_ else headers


def _get(base: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers=headers or {}, timeout=10)


def test_signature_round_trip_and_refusals() -> None:
    now = 1_800_000_000.0
    verifier = peerauth.RequestVerifier("holder", _site, max_skew=60, now=lambda: now + 10)
    signed = peerauth.sign_request(ME, "GET", "/sha256/x", "holder", now=lambda: now)
    headers = {k.lower(): v for k, v in signed.items()}
    assert verifier.verify("GET", "/sha256/x", headers) == ("asker", None)
    assert verifier.verify("GET", "/sha256/x", headers)[1] == "replayed request"
    fresh = {
        k.lower(): v
        for k, v in peerauth.sign_request(ME, "GET", "/sha256/x", "holder", now=lambda: now).items()
    }
    assert verifier.verify("GET", "/sha256/y", fresh)[1] == "bad signature"
    assert verifier.verify("HEAD", "/sha256/x", fresh)[1] == "bad signature"
    assert verifier.verify("GET", "/sha256/x", {**fresh, "range": "bytes=5-"})[1] == (
        "bad signature"  # the Range is signed: a captured request cannot ask for other bytes
    )
    late = peerauth.RequestVerifier("holder", _site, max_skew=60, now=lambda: now + 61)
    problem = late.verify("GET", "/sha256/x", fresh)[1]
    assert problem is not None and "more than 60s" in problem
    early = peerauth.RequestVerifier("holder", _site, max_skew=60, now=lambda: now - 61)
    assert early.verify("GET", "/sha256/x", fresh)[1] is not None  # a clock ahead is bounded too
    assert verifier.verify("GET", "/sha256/x", {})[1] == "no peer signature"
    # Meant for another peer of the site: the audience is signed.
    elsewhere = peerauth.RequestVerifier("third", _site, now=lambda: now)
    assert elsewhere.verify("GET", "/sha256/x", fresh)[1] == "bad signature"


def test_unsigned_badly_signed_and_expired_requests_get_403(
    holder: tuple[str, PeerServer],
) -> None:
    base, server = holder
    path = f"/sha256/{SHA}"
    assert _get(base, path).status_code == 403
    stranger = peerauth.Identity("asker")  # claims the name, has not the key
    assert _get(base, path, _sign(path, me=stranger)).status_code == 403
    stale = peerauth.sign_request(ME, "GET", path, "holder", now=lambda: time.time() - 3600)
    assert _get(base, path, stale).status_code == 403
    # A signature for one file does not open another.
    other = f"/sha256/{'1' * 64}"
    assert _get(base, other, _sign(path)).status_code == 403
    assert server.bytes_served == 0


def test_serves_whole_file_and_ranges(holder: tuple[str, PeerServer]) -> None:
    base, server = holder
    path = f"/sha256/{SHA}"
    whole = _get(base, path, _sign(path))
    assert whole.status_code == 200 and whole.content == DATA
    part = _get(base, path, _sign(path, "bytes=1000-"))
    assert part.status_code == 206 and part.content == DATA[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{SIZE - 1}/{SIZE}"
    mid = _get(base, path, _sign(path, "bytes=10-19"))
    assert mid.status_code == 206 and mid.content == DATA[10:20]
    past = _get(base, path, _sign(path, f"bytes={SIZE}-"))
    assert past.status_code == 416
    assert server.bytes_served == SIZE + (SIZE - 1000) + 10


def test_partials_and_unknown_digests_are_not_served(holder: tuple[str, PeerServer]) -> None:
    base, _ = holder
    for path in (f"/sha256/{'0' * 64}", f"/sha256/{'0' * 64}.partial", "/etc/passwd"):
        assert _get(base, path, _sign(path)).status_code == 404
    signed = peerauth.sign_request(ME, "POST", "/x", "holder")
    post = httpx.post(f"{base}/x", headers=signed)
    assert post.status_code == 405  # read-only, whoever asks


def _want(base: str, sha: str) -> Want:
    def signer(method: str, path: str, headers: dict[str, str]) -> dict[str, str]:
        range_ = headers.get("Range", "")
        return peerauth.sign_request(ME, method, path, "holder", range_=range_)

    def checker(resp: httpx.Response, request: dict[str, str]) -> str | None:
        return peerauth.verify_response(
            HOLDER.public,
            "holder",
            resp.status_code,
            resp.request.url.path,
            request=request,
            headers=resp.headers,
        )

    return Want(f"{base}/sha256/{sha}", sha, SIZE, signer=signer, checker=checker)


def test_peer_fetch_goes_through_the_verified_download(
    holder: tuple[str, PeerServer], tmp_path: Path
) -> None:
    base, _ = holder
    cache = ContentCache(tmp_path / "receiver")
    cache.blobs.mkdir(parents=True)
    cache.partial(SHA).write_bytes(DATA[: SIZE // 3])  # left by an interrupted transfer
    with httpx.Client(timeout=10) as client:
        cache.fetch(client, _want(base, SHA))
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
        cache.fetch(client, _want(base, wrong))
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
    server = PeerServer(cache, HOLDER, _site, "127.0.0.1", 0)
    server.start()
    try:
        path = f"/sha256/{sha}"
        url = f"http://127.0.0.1:{server.port}{path}"
        got = bytearray()
        with httpx.stream("GET", url, headers=_sign(path), timeout=30) as r:
            for i, chunk in enumerate(r.iter_bytes(1 << 20)):
                if i == 0:
                    time.sleep(1.0)
                got += chunk
    finally:
        server.close()
    assert hashlib.sha256(got).hexdigest() == sha
