"""The agent's peer port: site peers read complete cached files, `GET /sha256/<digest>`.

Runs on the node network (the DaemonSet uses hostNetwork, port `peer_port`) in one thread of
its own with an event loop, beside the agent's. Bounded whatever the LAN sends (issue 34,
hole 6):

- a connection that has not sent a whole request head within `header_timeout` (5 s) is
  closed; a head is at most 8 KiB;
- at most `max_pending` connections may be waiting for their head; one more closes the oldest
  of them (a flood of silent connections churns among itself, while a real peer's head arrives
  within milliseconds of its connect and leaves the pending set at once);
- nothing is done for a request before its signature is checked (`peerauth`: the asker's own
  node key, as published on its Node, known only for nodes of this agent's site), and a bad
  one gets a bare 403 and the connection is closed;
- at most `max_transfers` files are sent at once; each is sent with sendfile(2) (no copy
  through Python), in slices that must each finish within `send_timeout`, so a peer that
  stops reading lets go of its slot.

One request per connection (`Connection: close`). Only complete files are served — a final name
in the cache holds verified bytes, a `.partial` is never exposed — and `Range: bytes=N-` /
`bytes=N-M` is honoured (206 + Content-Range), so a peer's interrupted transfer resumes exactly
as one from the origin does. Every answer to an authenticated request is signed
(`X-Ember-Peer-Signature`), bound to the request's nonce.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import BinaryIO

from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.metrics import AgentMetrics

log = logging.getLogger("ember_runtime.nodeagent.peerserver")

_PATH = re.compile(r"^/sha256/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
HEAD_LIMIT = 8 << 10
SLICE_BYTES = 64 << 20


@dataclass
class Limits:
    header_timeout: float = 5.0
    max_pending: int = 4096
    max_transfers: int = 16
    send_timeout: float = 60.0  # for each slice of SLICE_BYTES


@dataclass
class Stats:
    accepted: int = 0
    timed_out: int = 0  # no whole head within header_timeout
    evicted: int = 0  # closed to make room for a newer connection
    refused: int = 0  # 403: unsigned, bad, stale, replayed, not of this site
    served: int = 0


class _Refused(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class PeerServer:
    def __init__(
        self,
        cache: ContentCache,
        me: peerauth.Identity,
        keys: peerauth.Keys,
        host: str = "0.0.0.0",  # noqa: S104 - the node network is the point
        port: int = 0,
        *,
        max_skew: float = peerauth.DEFAULT_MAX_SKEW,
        limits: Limits | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.cache, self.me = cache, me
        self.verifier = peerauth.RequestVerifier(me.node, keys, max_skew=max_skew)
        self.limits = limits or Limits()
        self.metrics = metrics
        self.stats = Stats()
        self.bytes_served = 0
        # Bound now, so the port is known (and taken) before start().
        self._sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self._sock.setblocking(False)
        self._pending: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def count(self, n: int) -> None:
        self.bytes_served += n  # one thread writes it
        if self.metrics is not None:
            self.metrics.served_bytes.inc(n)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="peer-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def close(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(5)
        self._sock.close()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        self._slots = asyncio.Semaphore(self.limits.max_transfers)
        server = await asyncio.start_server(self._handle, sock=self._sock, limit=HEAD_LIMIT)
        self._ready.set()
        async with server:
            await self._stopped.wait()
            for writer in list(self._pending):
                writer.transport.abort()

    # --- one connection ------------------------------------------------------------------

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        while len(self._pending) >= self.limits.max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            self.stats.evicted += 1
            oldest.transport.abort()
        self._pending[writer] = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        try:
            try:
                async with asyncio.timeout(self.limits.header_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                self.stats.timed_out += 1
                return
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return
            finally:
                self._pending.pop(writer, None)
            await self._answer(head, writer)
        except OSError as err:
            log.info("peer went away: %r", err)
        finally:
            writer.close()  # after what was written has gone out

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            method, path, headers = _parse(head)
            asker, problem = self.verifier.verify(method, path, headers)
            if problem is not None:
                raise _Refused(403, problem)
            if method != "GET":
                raise _Refused(405, "read-only")
        except _Refused as refused:
            self.stats.refused += refused.status == 403
            log.info("refused a request from %s: %s", peer, refused)
            writer.write(_head(refused.status, "", {"Content-Length": "0"}))
            await writer.drain()
            return
        nonce = headers.get(peerauth.NONCE_HEADER.lower(), "")
        assert self._slots is not None
        async with self._slots:
            await self._send_file(writer, path, headers.get("range", ""), nonce, asker)

    async def _send_file(
        self, writer: asyncio.StreamWriter, path: str, range_: str, nonce: str, asker: str
    ) -> None:
        match = _PATH.match(path)
        try:
            if match is None:
                raise FileNotFoundError(path)
            f = open(self.cache.path(match[1]), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            writer.write(self._signed(404, nonce, path, "", 0))
            await writer.drain()
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            status, start, end = _span(range_, size)
            if status == 416:
                writer.write(self._signed(416, nonce, path, f"bytes */{size}", 0))
                await writer.drain()
                return
            content_range = f"bytes {start}-{end}/{size}" if status == 206 else ""
            writer.write(self._signed(status, nonce, path, content_range, end - start + 1))
            await writer.drain()
            await self._sendfile(writer, f, start, end - start + 1)
        self.stats.served += 1
        log.debug("sent %s (%s) to %s", path, range_ or "whole", asker)

    async def _sendfile(
        self, writer: asyncio.StreamWriter, f: BinaryIO, start: int, n: int
    ) -> None:
        loop = asyncio.get_running_loop()
        offset, end = start, start + n
        while offset < end:
            count = min(SLICE_BYTES, end - offset)
            async with asyncio.timeout(self.limits.send_timeout):
                sent = await loop.sendfile(writer.transport, f, offset, count)
            self.count(sent)
            offset += sent
            if sent == 0:
                break

    def _signed(self, status: int, nonce: str, path: str, content_range: str, length: int) -> bytes:
        answer = peerauth.Answer(status, nonce, path, content_range, str(length))
        signature = peerauth.sign_response(self.me, answer)
        extra = {
            "Content-Length": str(length),
            "Accept-Ranges": "bytes",
            peerauth.RESPONSE_HEADER: signature,
        }
        return _head(status, content_range, extra)


_REASONS = {200: "OK", 206: "Partial Content", 403: "Forbidden", 404: "Not Found"}
_REASONS |= {405: "Method Not Allowed", 416: "Range Not Satisfiable", 400: "Bad Request"}


def _head(status: int, content_range: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", "Connection: close"]
    if content_range:
        lines.append(f"Content-Range: {content_range}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Request line and headers (names lower-cased); _Refused(400) when malformed."""
    try:
        text = head.decode("latin-1")
        line, *rest = text.split("\r\n")
        method, path, version = line.split(" ")
    except ValueError:
        raise _Refused(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise _Refused(400, "not HTTP/1.x")
    headers: dict[str, str] = {}
    for raw in rest:
        if not raw:
            continue
        name, sep, value = raw.partition(":")
        if not sep:
            raise _Refused(400, "malformed header")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


def _span(range_: str, size: int) -> tuple[int, int, int]:
    """(status, first byte, last byte) for a Range header (200 for none or one we ignore)."""
    ranged = _RANGE.match(range_)
    if not ranged:
        return 200, 0, size - 1
    start = int(ranged[1])
    end = min(int(ranged[2]), size - 1) if ranged[2] else size - 1
    if start >= size or start > end:
        return 416, 0, -1
    return 206, start, end
