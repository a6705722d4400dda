"""How site peers authenticate each other: per-node Ed25519 keys, published on each Node.

Each agent makes its own key pair when it starts (kept in memory only: a restart rotates it)
and publishes the public half on its own Node, annotation `ember.dev/peer-key`. Only that
node's agent (the chart's own-metadata policy: the token's node-name must be the Node's name)
and that node's kubelet (NodeRestriction) can write it, so the annotation binds the key to the
node. A peer's key is trusted only while its Node carries this agent's site label, which is
under node-restriction.kubernetes.io/ (the chart's siteSharing.siteLabel): a kubelet cannot
set it on itself, so no node can make itself a member of another site. Revoking a node is
taking its site label off (or deleting its Node): every peer's watch drops it at once. While
the API server is away, agents verify with the keys they last saw, so a partitioned site still
shares. No secret is shared by two nodes and none is held by the chart: one compromised node
can sign only as itself, and read only what its own site's peers hold.

A request carries

    X-Ember-Peer-Node: <asking node>
    X-Ember-Peer-Time: <unix seconds>
    X-Ember-Peer-Nonce: <32 hex digits, fresh per request>
    Authorization: EmberPeer <base64 Ed25519 signature>

over method, path, Range, asker, the node asked (the audience: a request captured on its way
to one peer opens no other), time and nonce. The serving agent refuses (403) a node it does
not know as a peer of its site, a bad signature, a time more than `max_skew` from its own
clock, and a nonce it has seen within that window (a replay). Its answer carries

    X-Ember-Peer-Signature: <base64 signature over status, the request's nonce, path,
                             Content-Range, Content-Length and the serving node>

so the asker knows the answer is the peer's to this very request. The body is not signed
(that would cost the sendfile path a pass over every byte): its integrity is the sha256 the
receiver checks every byte against, from its own spec.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

SCHEME = "EmberPeer"
NODE_HEADER = "X-Ember-Peer-Node"
TIME_HEADER = "X-Ember-Peer-Time"
NONCE_HEADER = "X-Ember-Peer-Nonce"
RESPONSE_HEADER = "X-Ember-Peer-Signature"
KEY_ANNOTATION = "ember.dev/peer-key"
DEFAULT_MAX_SKEW = 300.0
_NONCE_HEX = 32
_MAX_NONCES = 200_000  # a replay window's worth at a busy site; beyond it, refuse (fail shut)

Keys = Callable[[str], str | None]  # node name → its published key, if a peer of our site


class Identity:
    """This node's key pair: the private half never leaves the process."""

    def __init__(self, node: str, private: Ed25519PrivateKey | None = None) -> None:
        self.node = node
        self._private = private or Ed25519PrivateKey.generate()
        raw = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public = base64.b64encode(raw).decode()

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self._private.sign(message)).decode()


@lru_cache(maxsize=1024)
def _public_key(text: str) -> Ed25519PublicKey | None:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None
    except (binascii.Error, ValueError):
        return None


def check(key_text: str, message: bytes, signature: str) -> bool:
    key = _public_key(key_text)
    if key is None:
        return False
    try:
        key.verify(base64.b64decode(signature, validate=True), message)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def request_message(
    method: str, path: str, *, range_: str, asker: str, audience: str, stamp: str, nonce: str
) -> bytes:
    fields = ["ember-peer-request", method.upper(), path, range_, asker, audience, stamp, nonce]
    return "\n".join(fields).encode()


def sign_request(
    me: Identity,
    method: str,
    path: str,
    audience: str,
    *,
    range_: str = "",
    now: Callable[[], float] = time.time,
) -> dict[str, str]:
    """The headers that authenticate one request for `path` to the node `audience`."""
    stamp, nonce = str(int(now())), secrets.token_hex(_NONCE_HEX // 2)
    message = request_message(
        method, path, range_=range_, asker=me.node, audience=audience, stamp=stamp, nonce=nonce
    )
    return {
        NODE_HEADER: me.node,
        TIME_HEADER: stamp,
        NONCE_HEADER: nonce,
        "Authorization": f"{SCHEME} {me.sign(message)}",
    }


class RequestVerifier:
    """The serving side: who asks, whether they may, and that no request is used twice."""

    def __init__(
        self,
        node: str,
        keys: Keys,
        *,
        max_skew: float = DEFAULT_MAX_SKEW,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.node, self.keys, self.max_skew, self._now = node, keys, max_skew, now
        self._seen: dict[str, float] = {}  # nonce → when it may be forgotten
        self._lock = threading.Lock()

    def verify(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[str, str | None]:
        """(the asking node, None) when authentic, fresh and new; else (asker, why not) — for
        the log, not the peer: the answer is a bare 403. `headers` with lower-case names."""
        scheme, _, given = headers.get("authorization", "").partition(" ")
        asker = headers.get(NODE_HEADER.lower(), "")
        stamp, nonce = headers.get(TIME_HEADER.lower(), ""), headers.get(NONCE_HEADER.lower(), "")
        if scheme != SCHEME or not given or not asker or not stamp.isdigit():
            return asker, "no peer signature"
        if len(nonce) != _NONCE_HEX or any(c not in "0123456789abcdef" for c in nonce):
            return asker, "no nonce"
        now = self._now()
        if abs(now - int(stamp)) > self.max_skew:
            return asker, f"signature time {stamp} is more than {self.max_skew:.0f}s from ours"
        key = self.keys(asker)
        if key is None:
            return asker, f"{asker} is not a peer of this site"
        range_ = headers.get("range", "")
        message = request_message(
            method, path, range_=range_, asker=asker, audience=self.node, stamp=stamp, nonce=nonce
        )
        if not check(key, message, given):
            return asker, "bad signature"
        return asker, self._first_use(nonce, now)

    def _first_use(self, nonce: str, now: float) -> str | None:
        with self._lock:
            if len(self._seen) >= _MAX_NONCES:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
            if nonce in self._seen:
                return "replayed request"
            if len(self._seen) >= _MAX_NONCES:
                return "too many requests in the replay window"
            # Kept until the stamp could no longer pass the skew check either way.
            self._seen[nonce] = now + 2 * self.max_skew
            return None


@dataclass(frozen=True)
class Answer:
    """What a peer's signature on its answer covers (besides its own name)."""

    status: int
    nonce: str  # the request's
    path: str
    content_range: str
    length: str

    def message(self, server: str) -> bytes:
        fields = [self.status, self.nonce, self.path, self.content_range, self.length, server]
        return "\n".join(["ember-peer-response", *map(str, fields)]).encode()


def sign_response(me: Identity, answer: Answer) -> str:
    return me.sign(answer.message(me.node))


def verify_response(
    key: str | None,
    server: str,
    resp_status: int,
    path: str,
    *,
    request: Mapping[str, str],
    headers: Mapping[str, str],
) -> str | None:
    """None when the answer is `server`'s, to the request sent with headers `request`;
    otherwise why not. `headers` are the response's (any case)."""
    lower = {k.lower(): v for k, v in headers.items()}
    given = lower.get(RESPONSE_HEADER.lower(), "")
    if key is None:
        return f"no key known for peer {server}"
    if not given:
        return "unsigned peer response"
    answer = Answer(
        resp_status,
        request.get(NONCE_HEADER, ""),
        path,
        lower.get("content-range", ""),
        lower.get("content-length", ""),
    )
    return None if check(key, answer.message(server), given) else "bad peer response signature"
