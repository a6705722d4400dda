"""Issue 34, hole 6: what the peer port gives whom, attacked over real sockets.

Each node signs with its own key; the server accepts only keys of its own site's Nodes, each
request once, and signs its answers to that very request. The port stays bounded whatever the
LAN sends: silent connections are dropped at the header timeout, a flood evicts only its own
kind, and a real transfer keeps its pace under 2,000 slow connections (small here; the 1 GiB
figures come from bench/peer_slowloris.py)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from ember_runtime.contract import reasons
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache, FetchError, Want
from ember_runtime.nodeagent.peerserver import Limits, PeerServer

from tests.nodeagent import slowloris
from tests.support.waiting import wait_for

SIZE = (1 << 20) + 123
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
PATH = f"/sha256/{SHA}"
HOLDER, X, Y = (peerauth.Identity(n) for n in ("holder", "node-x", "node-y"))
OUTSIDER = peerauth.Identity("node-z")  # a node of another site: its key is not ours to know


def _site(node: str) -> str | None:
    return {"node-x": X.public, "node-y": Y.public, "holder": HOLDER.public}.get(node)


def _holder_cache(root: Path, data: bytes = DATA) -> ContentCache:
    cache = ContentCache(root)
    cache.blobs.mkdir(parents=True, exist_ok=True)
    cache.path(hashlib.sha256(data).hexdigest()).write_bytes(data)
    return cache


def _start_holder(root: Path, header_timeout: float) -> PeerServer:
    server = PeerServer(
        _holder_cache(root),
        HOLDER,
        _site,
        "127.0.0.1",
        0,
        limits=Limits(header_timeout=header_timeout, max_pending=64),
    )
    server.start()
    return server


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[PeerServer]:
    server = _start_holder(tmp_path / "holder", header_timeout=1.0)
    yield server
    server.close()


@pytest.fixture
def patient_holder(tmp_path: Path) -> Iterator[PeerServer]:
    """A header timeout longer than any test: only eviction can close a silent connection."""
    server = _start_holder(tmp_path / "holder", header_timeout=60.0)
    yield server
    server.close()


def _url(server: PeerServer, path: str = PATH) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def test_a_replayed_request_is_refused(holder: PeerServer) -> None:
    """A request captured on the LAN (its signature still fresh) fetches nothing again."""
    signed = peerauth.sign_request(X, "GET", PATH, "holder")
    first = httpx.get(_url(holder), headers=signed, timeout=10)
    assert first.status_code == 200 and first.content == DATA
    again = httpx.get(_url(holder), headers=signed, timeout=10)
    assert again.status_code == 403 and again.content == b""
    assert holder.bytes_served == SIZE


def test_a_request_cannot_be_moved_to_other_bytes_or_another_peer(holder: PeerServer) -> None:
    """The Range and the peer asked are signed: a captured request cannot be re-aimed."""
    signed = peerauth.sign_request(X, "GET", PATH, "holder", range_="bytes=0-9")
    moved = httpx.get(_url(holder), headers={**signed, "Range": "bytes=10-"}, timeout=10)
    assert moved.status_code == 403
    for_other = peerauth.sign_request(X, "GET", PATH, "another-holder")
    assert httpx.get(_url(holder), headers=for_other, timeout=10).status_code == 403
    assert holder.bytes_served == 0


def test_node_x_cannot_ask_as_node_y(holder: PeerServer) -> None:
    """X signs with its own key but names Y: refused (keys are per node, not per fleet)."""
    as_y = peerauth.sign_request(X, "GET", PATH, "holder")
    as_y[peerauth.NODE_HEADER] = "node-y"
    assert httpx.get(_url(holder), headers=as_y, timeout=10).status_code == 403
    # Re-signed under Y's name with X's key: the same.
    impostor = peerauth.Identity("node-y")  # not Y's key pair
    signed = peerauth.sign_request(impostor, "GET", PATH, "holder")
    assert httpx.get(_url(holder), headers=signed, timeout=10).status_code == 403
    # Y itself is served.
    real = peerauth.sign_request(Y, "GET", PATH, "holder")
    assert httpx.get(_url(holder), headers=real, timeout=10).status_code == 200


def test_a_node_of_another_site_reads_nothing(holder: PeerServer) -> None:
    signed = peerauth.sign_request(OUTSIDER, "GET", PATH, "holder")
    assert httpx.get(_url(holder), headers=signed, timeout=10).status_code == 403
    assert holder.bytes_served == 0


class _Tamper(http.server.BaseHTTPRequestHandler):
    """A man in the middle: forwards the request to the real holder, changes the answer."""

    upstream = ""
    change: Callable[[int, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        with httpx.Client() as client:
            got = client.get(self.upstream + self.path, headers=headers, timeout=10)
        status, out, body = type(self).change(got.status_code, dict(got.headers), got.content)
        self.send_response(status)
        for k, v in out.items():
            if k.lower() not in {"content-length", "connection", "date", "server"}:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client hangs up once it sees the tampering
            self.wfile.write(body)


@pytest.fixture
def tamper(holder: PeerServer) -> Iterator[type[_Tamper]]:
    handler = type("Tamper", (_Tamper,), {"upstream": f"http://127.0.0.1:{holder.port}"})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    handler.port = proxy.server_address[1]  # type: ignore[attr-defined]
    yield handler
    proxy.shutdown()
    proxy.server_close()


def _want(port: int) -> Want:
    def signer(method: str, path: str, headers: dict[str, str]) -> dict[str, str]:
        range_ = headers.get("Range", "")
        return peerauth.sign_request(X, method, path, "holder", range_=range_)

    def checker(resp: httpx.Response, request: dict[str, str]) -> str | None:
        path = resp.request.url.path
        return peerauth.verify_response(
            HOLDER.public, "holder", resp.status_code, path, request=request, headers=resp.headers
        )

    return Want(f"http://127.0.0.1:{port}{PATH}", SHA, SIZE, signer=signer, checker=checker)


def _fetch(tmp_path: Path, port: int) -> tuple[ContentCache, FetchError]:
    cache = ContentCache(tmp_path / "receiver")
    with httpx.Client(timeout=10) as client, pytest.raises(FetchError) as info:
        cache.fetch(client, _want(port), attempts=1)
    return cache, info.value


def test_a_tampered_response_is_detected(tmp_path: Path, tamper: type[_Tamper]) -> None:
    port = tamper.port  # type: ignore[attr-defined]
    # The answer's signed headers changed (a 206 presented as another part of the file).
    tamper.change = staticmethod(
        lambda s, h, b: (s, {**h, "Content-Range": f"bytes 0-{SIZE - 1}/{SIZE + 1}"}, b)
    )
    cache, err = _fetch(tmp_path, port)
    assert "bad peer response signature" in str(err), err
    # An answer signed for another request (the nonce is the request's).
    replayed = peerauth.sign_request(X, "GET", PATH, "holder")
    old = httpx.get(f"http://127.0.0.1:{port}{PATH}", headers=replayed, timeout=10)
    sig = old.headers[peerauth.RESPONSE_HEADER]
    tamper.change = staticmethod(lambda s, h, b: (s, {**h, peerauth.RESPONSE_HEADER: sig}, b))
    _, err = _fetch(tmp_path, port)
    assert "bad peer response signature" in str(err), err
    # Unsigned (someone else answering on the peer's address).
    tamper.change = staticmethod(
        lambda s, h, b: (s, {k: v for k, v in h.items() if "signature" not in k.lower()}, b)
    )
    _, err = _fetch(tmp_path, port)
    assert "unsigned peer response" in str(err), err
    # The body changed (headers intact): the sha256 the receiver checks every byte against.
    flipped = staticmethod(lambda s, h, b: (s, h, bytes([b[0] ^ 1]) + b[1:]))
    tamper.change = flipped
    _, err = _fetch(tmp_path, port)
    assert err.reason == reasons.CHECKSUM_MISMATCH
    assert cache.held() == []


def test_a_silent_connection_is_dropped_at_the_header_timeout(holder: PeerServer) -> None:
    """Before: a thread per connection held it for 60 s. Now: closed after header_timeout."""
    with socket.create_connection(("127.0.0.1", holder.port)) as silent:
        silent.settimeout(10)
        started = time.monotonic()
        assert silent.recv(1) == b""  # closed by the server, nothing said
        assert time.monotonic() - started < 3.0
    assert holder.stats.timed_out >= 1


def test_a_flood_evicts_its_own_kind_and_holds_no_thread_each(patient_holder: PeerServer) -> None:
    """More silent connections than max_pending (64): the oldest are closed, the server holds
    no thread per connection, and a real peer connecting last is served at once. (With a short
    header timeout a loaded machine let timeouts close some first, and the count raced.)"""
    holder = patient_holder
    threads = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", holder.port)) for _ in range(200)]
    try:
        # Under load (the whole suite on 2 cores) the accept loop may lag: wait for it.
        wait_for("the oldest evicted", lambda: holder.stats.evicted >= 200 - 64, 10, 0.05)
        # A thread per connection would be 200 more; allow the suite's own comings and goings.
        assert threading.active_count() < threads + 20
        signed = peerauth.sign_request(X, "GET", PATH, "holder")
        started = time.monotonic()
        got = httpx.get(_url(holder), headers=signed, timeout=10)
        assert got.status_code == 200 and got.content == DATA
        assert time.monotonic() - started < 3.0  # not behind the 5 s header timeout
    finally:
        for s in flood:
            s.close()


@pytest.mark.timeout(180)
def test_a_transfer_keeps_its_pace_under_2000_slow_connections(tmp_path: Path) -> None:
    """The server process holds no thread per connection, and the median of 5 transfers under
    attack stays near the unloaded median. The goal, 1.2x, is measured at 1 GiB by
    bench/peer_slowloris.py; here (128 MiB, on a 2-core machine the attacker's reconnects share)
    the bound is 1.5x, which still catches a server that makes the transfer queue behind slow
    connections."""
    data = os.urandom(128 << 20)
    _holder_cache(tmp_path / "holder", data)
    figures = slowloris.measure(
        tmp_path / "holder", hashlib.sha256(data).hexdigest(), len(data), 2000
    )
    report = figures.report()
    unloaded = sorted(figures.unloaded_s)[2]
    assert sorted(figures.loaded_s)[2] <= 1.5 * unloaded, report
    assert figures.threads_under_attack < 20, report
    assert figures.attacker["opened"] >= 2000, report
    print(report)
