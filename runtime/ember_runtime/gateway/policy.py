"""Which replica takes a request: pure functions of the replicas' last known state.

1. Only replicas that answered their last probe and are not draining are candidates.
2. load = max(active + queued as the replica last reported, requests the gateway has in flight
   there); headroom = batch limit − load. Tiers, best first: cool with headroom, throttled with
   headroom, cool without, throttled without, and last the shedding ones (their runtime says
   Critical: the batch is at its floor and the device still heats, the thermal ladder's second
   step), whatever their headroom. A throttled replica is never preferred while a cool one has
   room; a shedding one takes new work only when no other replica is live.
3. Within the first non-empty tier, a prompt of at least `min_prefix` characters goes by
   consistent hashing with bounded loads: the hash of its first `prefix_chars` characters picks a
   point on a ring of virtual nodes; the first replica from there whose load is below
   ceil(c × (tier load + 1) / tier size) takes it. The same prefix meets the same replica (and
   its prefix cache) until that replica carries more than c times the average.
   A shorter prompt goes to the replica with the most headroom (ties: fewest in flight).
4. The rest of the candidates follow in headroom order: where the request fails over to.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ember_runtime.contract.thermal import REASON_CRITICAL, REASON_THROTTLED

VIRTUAL_NODES = 64


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the policy knows of one replica at the moment of the choice."""

    key: str  # stable identity (the pod's name, or its address)
    batch_limit: int
    active: int
    queued: int
    inflight: int  # requests this gateway has sent there and not finished
    throttled: bool
    healthy: bool = True
    draining: bool = False
    shedding: bool = False

    @property
    def load(self) -> int:
        return max(self.active + self.queued, self.inflight)

    @property
    def headroom(self) -> int:
        return self.batch_limit - self.load


def is_shedding(reason: str) -> bool:
    """The runtime's thermal ladder asks for its new work to go to cooler peers."""
    return reason == REASON_CRITICAL


def is_throttled(reason: str, batch_limit: int, capacity: int) -> bool:
    """The runtime's own verdict (its thermal reason), or a limit lowered by hand."""
    return reason in (REASON_THROTTLED, REASON_CRITICAL) or batch_limit < capacity


@dataclass(frozen=True, slots=True)
class Policy:
    prefix_chars: int = 256  # about 64 tokens of English: a system prompt's worth
    min_prefix: int = 64  # shorter prompts carry no prefix worth following
    load_factor: float = 1.25  # c of consistent hashing with bounded loads


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=64)
def _ring(keys: tuple[str, ...]) -> list[tuple[int, str]]:
    """The ring of a set of replicas, built once per set (a request only looks it up)."""
    return sorted((_point(f"{k}#{i}"), k) for k in keys for i in range(VIRTUAL_NODES))


def ring_order(keys: Sequence[str], prefix: str) -> list[str]:
    """Every key once, in the order met walking the ring clockwise from the prefix's point."""
    ring = _ring(tuple(sorted(keys)))
    start = bisect.bisect_left(ring, (_point(prefix), ""))
    seen: list[str] = []
    for j in range(len(ring)):
        key = ring[(start + j) % len(ring)][1]
        if key not in seen:
            seen.append(key)
            if len(seen) == len(keys):
                break
    return seen


def _tiers(replicas: Sequence[ReplicaView]) -> list[list[ReplicaView]]:
    live = [r for r in replicas if r.healthy and not r.draining]
    serving = [r for r in live if not r.shedding]
    room = [r for r in serving if r.headroom > 0]
    full = [r for r in serving if r.headroom <= 0]
    tiers = [
        [r for r in room if not r.throttled],
        [r for r in room if r.throttled],
        [r for r in full if not r.throttled],
        [r for r in full if r.throttled],
        [r for r in live if r.shedding],
    ]
    return [t for t in tiers if t]


def _by_headroom(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    return sorted(replicas, key=lambda r: (-r.headroom, r.inflight, r.key))


def _affine(tier: Sequence[ReplicaView], prefix: str, factor: float) -> ReplicaView | None:
    bound = math.ceil(factor * (sum(r.load for r in tier) + 1) / len(tier))
    by_key = {r.key: r for r in tier}
    for key in ring_order(list(by_key), prefix):
        if by_key[key].load < bound:
            return by_key[key]
    return None


def order(replicas: Sequence[ReplicaView], prompt: str, policy: Policy) -> list[ReplicaView]:
    """The candidates, best first; empty when none is healthy."""
    tiers = _tiers(replicas)
    if not tiers:
        return []
    first = _by_headroom(tiers[0])
    if len(prompt) >= policy.min_prefix:
        chosen = _affine(tiers[0], prompt[: policy.prefix_chars], policy.load_factor)
        if chosen is not None:
            first.remove(chosen)
            first.insert(0, chosen)
    return first + [r for tier in tiers[1:] for r in _by_headroom(tier)]
