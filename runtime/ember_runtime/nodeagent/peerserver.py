"""The agent's peer port: site peers read complete cached files, `GET /sha256/<digest>`.

Runs on the node network (the DaemonSet uses hostNetwork, port `peer_port`), in threads beside
the agent's event loop: one thread per connection, the body sent with sendfile(2), so serving
a model to the rest of the site costs the node almost no CPU. Only complete files are served —
a final name in the cache holds verified bytes, a `.partial` is never exposed — and
`Range: bytes=N-` / `bytes=N-M` is honoured (206 + Content-Range), so a peer's interrupted
transfer resumes exactly as one from the origin does. Every request must carry a fresh HMAC
(`peerauth`); anything else is a bare 403/404/405.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO

from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.metrics import AgentMetrics

log = logging.getLogger("ember_runtime.nodeagent.peerserver")

_PATH = re.compile(r"^/sha256/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    server: PeerServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # a peer that stops reading does not hold a thread for ever

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _refuse(self, status: int, why: str) -> None:
        log.info("refused %s %s from %s: %s", self.command, self.path, self.client_address[0], why)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        srv = self.server
        headers = {k.lower(): v for k, v in self.headers.items()}
        problem = peerauth.verify(srv.key.get(), "GET", self.path, headers, max_skew=srv.max_skew)
        if problem is not None:
            self._refuse(403, problem)
            return
        match = _PATH.match(self.path)
        if match is None:
            self._refuse(404, "not a cache path")
            return
        try:
            with open(srv.cache.path(match[1]), "rb") as f:
                self._send(f, os.fstat(f.fileno()).st_size, headers.get("range", ""))
        except FileNotFoundError:
            self._refuse(404, "not held")
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as err:
            log.info("peer %s went away: %r", self.client_address[0], err)

    def do_POST(self) -> None:
        self._refuse(405, "read-only")

    do_PUT = do_DELETE = do_PATCH = do_POST

    def _send(self, f: BinaryIO, size: int, range_header: str) -> None:
        start, end = 0, size - 1
        ranged = _RANGE.match(range_header)
        if ranged:
            start = int(ranged[1])
            end = min(int(ranged[2]), end) if ranged[2] else end
            if start >= size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.flush()
        # socket.sendfile, not os.sendfile: the handler's timeout puts the socket in
        # non-blocking mode, where os.sendfile fails with EAGAIN once the send buffer is full;
        # the socket method waits for it (and still uses sendfile(2)).
        sent = self.connection.sendfile(f, start, end - start + 1)
        self.server.count(sent)


class PeerServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        cache: ContentCache,
        key: peerauth.PeerKey,
        host: str = "0.0.0.0",  # noqa: S104 - the node network is the point
        port: int = 0,
        max_skew: float = peerauth.DEFAULT_MAX_SKEW,
        *,
        metrics: AgentMetrics | None = None,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.cache, self.key, self.max_skew = cache, key, max_skew
        self.metrics = metrics
        self.bytes_served = 0
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_served += n
        if self.metrics is not None:
            self.metrics.served_bytes.inc(n)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="peer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5)
