"""The replica-picking policy, as pure functions (no sockets)."""

from __future__ import annotations

from collections import Counter

from ember_runtime.gateway.policy import (
    Policy,
    ReplicaView,
    is_shedding,
    is_throttled,
    order,
    ring_order,
)

POLICY = Policy(prefix_chars=32, min_prefix=16, load_factor=1.25)
LONG = "You are a helpful assistant. " * 4


def rep(key: str, limit: int = 4, active: int = 0, queued: int = 0, **kw: object) -> ReplicaView:
    fields = {"inflight": 0, "throttled": False, "healthy": True, "draining": False, **kw}
    return ReplicaView(key, limit, active, queued, **fields)  # type: ignore[arg-type]


def keys(replicas: list[ReplicaView]) -> list[str]:
    return [r.key for r in replicas]


def test_most_headroom_first_for_a_short_prompt() -> None:
    got = order([rep("a", active=3), rep("b", active=1), rep("c", limit=8, active=3)], "hi", POLICY)
    assert keys(got) == ["c", "b", "a"]  # headroom 5, 3, 1


def test_load_is_the_larger_of_reported_and_in_flight() -> None:
    got = order([rep("a", inflight=3), rep("b", active=1, queued=1)], "hi", POLICY)
    assert keys(got) == ["b", "a"]


def test_a_throttled_replica_is_never_preferred_while_a_cool_one_has_room() -> None:
    cool = rep("cool", active=3)  # headroom 1
    hot = rep("hot", limit=16, throttled=True)  # headroom 16, but hot
    for prompt in ("hi", LONG, LONG + "x"):
        assert keys(order([hot, cool], prompt, POLICY)) == ["cool", "hot"]


def test_a_throttled_replica_with_room_beats_a_full_cool_one() -> None:
    got = order([rep("cool", active=4), rep("hot", limit=2, throttled=True)], "hi", POLICY)
    assert keys(got) == ["hot", "cool"]


def test_a_shedding_replica_goes_last_even_with_room_but_still_serves_alone() -> None:
    """The thermal ladder's second step: a Critical replica takes new work only when no other
    live replica exists, however full the others are."""
    shedding = rep("hot", limit=4, throttled=True, shedding=True)  # floor, headroom 4
    full = rep("cool", active=9)  # far past its batch
    for prompt in ("hi", LONG):
        assert keys(order([shedding, full], prompt, POLICY)) == ["cool", "hot"]
    assert keys(order([shedding, rep("cool", healthy=False)], "hi", POLICY)) == ["hot"]
    assert is_shedding("Critical") and not is_shedding("Throttled")


def test_unhealthy_and_draining_replicas_are_no_candidates() -> None:
    got = order([rep("down", healthy=False), rep("drain", draining=True), rep("ok")], "x", POLICY)
    assert keys(got) == ["ok"]
    assert order([rep("down", healthy=False)], "x", POLICY) == []


def test_throttled_verdict() -> None:
    assert is_throttled("Throttled", 4, 4)
    assert is_throttled("Critical", 0, 4)
    assert is_throttled("Normal", 2, 4)  # lowered by hand (PUT /admin/batch)
    assert not is_throttled("Normal", 4, 4)
    assert not is_throttled("NoReading", 4, 4)


def test_same_prefix_same_replica_whatever_follows() -> None:
    replicas = [rep(k) for k in "abcdef"]
    first = {order(replicas, LONG + f"question {i}", POLICY)[0].key for i in range(20)}
    assert len(first) == 1


def test_prefixes_spread_over_the_replicas() -> None:
    replicas = [rep(k) for k in "abcd"]
    firsts = Counter(order(replicas, f"{i:04d}" + LONG, POLICY)[0].key for i in range(400))
    assert set(firsts) == set("abcd")
    assert min(firsts.values()) > 40  # 64 virtual nodes each: no replica starves


def test_bounded_load_moves_a_hot_prefix_on() -> None:
    preferred = order([rep("a"), rep("b")], LONG, POLICY)[0].key
    other = "b" if preferred == "a" else "a"
    # bound = ceil(1.25 * (load 2 + 1) / 2) = 2: the preferred replica at load 2 is over it.
    got = order([rep(preferred, inflight=2), rep(other)], LONG, POLICY)
    assert got[0].key == other
    # at load 1 (bound ceil(1.25 * 2 / 2) = 2) it keeps the prefix although b has more room
    assert order([rep(preferred, inflight=1), rep(other)], LONG, POLICY)[0].key == preferred


def test_removing_a_replica_moves_only_its_prefixes() -> None:
    prompts = [f"{i:04d}" + LONG for i in range(300)]
    before = {p: ring_order(list("abcd"), p[:32])[0] for p in prompts}
    after = {p: ring_order(list("abc"), p[:32])[0] for p in prompts}
    moved = [p for p in prompts if before[p] != after[p]]
    assert moved and all(before[p] == "d" for p in moved)


def test_failover_order_lists_every_candidate_once() -> None:
    replicas = [rep("a"), rep("b", throttled=True), rep("c", active=4), rep("d", active=1)]
    got = keys(order(replicas, LONG, POLICY))
    assert sorted(got) == ["a", "b", "c", "d"]
    assert got[-2:] == ["b", "c"]  # the throttled one with room, then the full one
