"""A model origin for tests that honours HTTP `Range` (Python's http.server ignores it).

Serves in-memory files by path, answers `Range: bytes=N-` / `bytes=N-M` with 206 and a
`Content-Range`, counts every body byte it sends (`bytes_sent`), records each request's headers,
and can be told to cut the connection after a number of body bytes (`cut_after`, once per
value set; `cut_always`, every response), which is what an interrupted WAN transfer (or a peer
that sends some bytes and hangs up) looks like to the client. `paths` lists what was asked.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 64 << 10


@dataclass
class OriginState:
    files: dict[str, bytes]
    bytes_sent: int = 0
    cut_after: int | None = None  # cut the next response after this many body bytes
    cut_always: int | None = None  # cut every response after this many body bytes
    ignore_range: bool = False
    requests: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # each request's path, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, n: int) -> None:
        with self.lock:
            self.bytes_sent += n


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: pytest shows failures, not every request

    def do_GET(self) -> None:
        state = self.server.state
        with state.lock:
            state.requests.append({k.lower(): v for k, v in self.headers.items()})
            state.paths.append(self.path)
        data = state.files.get(self.path.split("?", 1)[0].lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        start, end = 0, len(data) - 1
        match = _RANGE.match(self.headers.get("Range", ""))
        if match and not state.ignore_range:
            start = int(match[1])
            end = min(int(match[2]), end) if match[2] else end
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._send_body(data[start : end + 1])

    def _send_body(self, body: bytes) -> None:
        state = self.server.state
        with state.lock:
            cut, state.cut_after = state.cut_after, None
            cut = state.cut_always if cut is None else cut
        limit = len(body) if cut is None else min(cut, len(body))
        for offset in range(0, limit, _CHUNK):
            piece = body[offset : min(offset + _CHUNK, limit)]
            self.wfile.write(piece)
            state.count(len(piece))
        if limit < len(body):
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees the stream end early


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: OriginState) -> None:
        super().__init__(address, _Handler)
        self.state = state


@contextmanager
def serve(
    files: dict[str, bytes], host: str = "127.0.0.1", port: int = 0
) -> Iterator[tuple[str, OriginState]]:
    """(base URL, state) of an origin serving `files` until the block ends."""
    state = OriginState(files=files)
    server = _Server((host, port), state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
