"""Origin credentials do not follow a redirect to another host (issue 34, hole 1): model hubs
redirect to CDNs, so the agent follows redirects, and httpx drops `Authorization` when the
origin changes. A guard on that behaviour, with the agent's own client settings, against two
real local servers. No cluster."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from ember_runtime.nodeagent.cache import ContentCache, Want
from ember_runtime.nodeagent.credentials import auth_headers

from tests.nodeagent.origin import serve

DATA = os.urandom(100_000)
SHA = hashlib.sha256(DATA).hexdigest()


@contextmanager
def redirecting(to: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server answering every GET with 302 to `to`; (its URL, the headers it saw)."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(302)
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_credentials_stay_on_their_origin_across_a_redirect(tmp_path: Path) -> None:
    with serve({"m.gguf": DATA}) as (cdn, cdn_state), redirecting(f"{cdn}/m.gguf") as (hub, seen):
        url = f"{hub}/m.gguf"
        headers = auth_headers("origin", {"token": "t0ken", "urlPrefix": hub}, url)
        cache = ContentCache(tmp_path)
        # The agent's client (fetcher.Fetcher): redirects followed.
        with httpx.Client(timeout=httpx.Timeout(30.0), follow_redirects=True) as client:
            cache.fetch(client, Want(url, SHA, len(DATA), headers=headers))
    assert seen[0]["authorization"] == "Bearer t0ken"  # the origin the Secret names got it
    assert cdn_state.requests and all("authorization" not in r for r in cdn_state.requests)
    assert cache.path(SHA).read_bytes() == DATA
