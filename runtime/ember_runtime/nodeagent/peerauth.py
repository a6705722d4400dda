"""How site peers authenticate each other: an HMAC over method, path and time.

Every agent of a fleet holds the same key, a file mounted from a Secret in the agent's own
namespace (the chart creates it, `<release>-nodeagent-peer`). A request carries

    X-Ember-Peer-Time: <unix seconds>
    Authorization: EmberPeer <hex HMAC-SHA256(key, "GET\\n/sha256/<digest>\\n<time>")>

and the serving agent recomputes the HMAC and refuses (403) a mismatch or a time more than
`max_skew` seconds (default 300) from its own clock. What this buys: only holders of the key
can read cached models from an agent's port, and a captured request cannot be replayed after
the skew bound (within it, it fetches only the same public-by-digest file again). What it does
not: encrypt the LAN (the bytes are models the spec names by sha256, and the receiver verifies
every byte against that digest, so a peer cannot feed a wrong model either way).

The key file is read again at most every few seconds, so a rotated Secret takes effect without
restarting the agents (the kubelet updates the mounted file in place).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from pathlib import Path

SCHEME = "EmberPeer"
TIME_HEADER = "X-Ember-Peer-Time"
DEFAULT_MAX_SKEW = 300.0
_KEY_REFRESH_SECONDS = 5.0


class PeerKey:
    """The shared key from its file, re-read when older than a few seconds."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._clock = path, clock
        self._key = b""
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def get(self) -> bytes:
        with self._lock:
            now = self._clock()
            if now - self._read_at >= _KEY_REFRESH_SECONDS:
                key = self.path.read_bytes().strip()
                if len(key) < 16:
                    raise ValueError(f"peer key {self.path} is shorter than 16 bytes")
                self._key, self._read_at = key, now
            return self._key


def signature(key: bytes, method: str, path: str, stamp: int) -> str:
    message = f"{method.upper()}\n{path}\n{stamp}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(
    key: bytes, method: str, path: str, now: Callable[[], float] = time.time
) -> dict[str, str]:
    """The headers that authenticate one request for `path`."""
    stamp = int(now())
    return {
        TIME_HEADER: str(stamp),
        "Authorization": f"{SCHEME} {signature(key, method, path, stamp)}",
    }


def verify(
    key: bytes,
    method: str,
    path: str,
    headers: dict[str, str],
    *,
    max_skew: float = DEFAULT_MAX_SKEW,
    now: Callable[[], float] = time.time,
) -> str | None:
    """None when the request is authentic and fresh; otherwise why not (for the log, not the
    peer: the answer is a bare 403). `headers` with lower-case names."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    stamp_text = headers.get(TIME_HEADER.lower(), "")
    if scheme != SCHEME or not given or not stamp_text.isdigit():
        return "no peer signature"
    stamp = int(stamp_text)
    if abs(now() - stamp) > max_skew:
        return f"signature time {stamp} is more than {max_skew:.0f}s from ours"
    if not hmac.compare_digest(given, signature(key, method, path, stamp)):
        return "bad signature"
    return None
