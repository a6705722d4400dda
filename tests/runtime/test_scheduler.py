"""The scheduling policy alone (engines/scheduler.py): no model, no llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from ember_runtime.engines.scheduler import (
    Call,
    Policy,
    admissible,
    plan_step,
    queued,
    split_active,
)


@dataclass
class Seq:
    name: str
    prompt_len: int
    prefilled: int = 0


def decoding(name: str) -> Seq:
    return Seq(name, 10, 10)


def layout(calls: list[Call[Seq]]) -> list[tuple[list[str], list[tuple[str, int, int]]]]:
    return [
        ([s.name for s in c.decodes], [(k.seq.name, k.start, k.count) for k in c.chunks])
        for c in calls
    ]


def run_prompts(seqs: list[Seq], policy: Policy) -> list[list[tuple[str, int, int]]]:
    """Plan steps until every prompt is in, as the engine would; the chunks of each step."""
    steps = []
    while any(s.prefilled < s.prompt_len for s in seqs):
        chunks = [k for c in plan_step(seqs, policy) for k in c.chunks]
        for k in chunks:
            k.seq.prefilled = k.start + k.count
        steps.append([(k.seq.name, k.start, k.count) for k in chunks])
    return steps


def test_fast_mode_is_one_call_with_every_decode_and_waiting_prompts() -> None:
    seqs = [decoding("a"), decoding("b"), Seq("c", 40), Seq("d", 30)]
    calls = plan_step(seqs, Policy(step_tokens=256))
    assert layout(calls) == [(["a", "b"], [("c", 0, 40), ("d", 0, 30)])]
    assert calls[0].rows == 72
    assert [k.completes_prompt for k in calls[0].chunks] == [True, True]


def test_long_prompt_is_chunked_and_running_streams_decode_every_step() -> None:
    a, long = decoding("a"), Seq("long", 600)
    policy = Policy(step_tokens=256)
    seen = []
    while long.prefilled < long.prompt_len:
        (call,) = plan_step([a, long], policy)
        assert [s.name for s in call.decodes] == ["a"]  # never starved by the long prompt
        (chunk,) = call.chunks
        seen.append((chunk.start, chunk.count, chunk.completes_prompt))
        long.prefilled += chunk.count
    assert seen == [(0, 256, False), (256, 256, False), (512, 88, True)]


def test_burst_of_prompts_shares_the_budget_in_arrival_order() -> None:
    burst = [Seq(f"p{i}", 100) for i in range(4)]
    steps = run_prompts(burst, Policy(step_tokens=256))
    assert steps == [
        [("p0", 0, 100), ("p1", 0, 100), ("p2", 0, 56)],
        [("p2", 56, 44), ("p3", 0, 100)],
    ]


def test_one_sequence_takes_at_most_a_chunk_and_the_budget_goes_to_the_next() -> None:
    # A long prompt in one call pays attention over the masked half of its cells: it goes in
    # chunks, while a short prompt behind it still starts in the same step.
    long, short = Seq("long", 700), Seq("short", 40)
    steps = run_prompts([long, short], Policy(step_tokens=1024, chunk_tokens=256))
    assert steps == [
        [("long", 0, 256), ("short", 0, 40)],
        [("long", 256, 256)],
        [("long", 512, 188)],
    ]
    # No tail step of a few tokens: up to half a chunk more goes in the last chunk.
    assert run_prompts([Seq("summary", 300)], Policy(chunk_tokens=256)) == [[("summary", 0, 300)]]
    assert run_prompts([Seq("edit", 800)], Policy(chunk_tokens=256)) == [
        [("edit", 0, 256)],
        [("edit", 256, 256)],
        [("edit", 512, 288)],
    ]


def test_prefix_reuse_starts_mid_prompt() -> None:
    (call,) = plan_step([Seq("x", 300, 290)], Policy())
    assert layout([call]) == [([], [("x", 290, 10)])]


def test_nothing_to_do_is_no_call() -> None:
    assert plan_step([], Policy()) == []


def test_deterministic_groups_decodes_by_the_probed_width() -> None:
    seqs = [decoding(c) for c in "abcdefghij"]
    calls = plan_step(seqs, Policy(deterministic=True, exact_rows=4))
    assert layout(calls) == [(list("abcd"), []), (list("efgh"), []), (list("ij"), [])]


def test_deterministic_prompt_is_alone_and_cut_where_it_would_be_alone() -> None:
    policy = Policy(deterministic=True, step_tokens=64, exact_rows=7)
    alone = run_prompts([Seq("p", 150)], policy)
    crowd = [Seq("q", 30), Seq("p", 150), Seq("r", 70)]
    together = run_prompts(crowd, policy)
    assert alone == [[("p", 0, 64)], [("p", 64, 64)], [("p", 128, 22)]]
    # one prompt chunk per step, each in its own call, with the same cuts as alone
    assert [k for step in together for k in step if k[0] == "p"] == [k[0] for k in alone]
    assert all(len(step) == 1 for step in together)
    calls = plan_step([decoding("a"), Seq("p", 150)], policy)
    assert layout(calls) == [(["a"], []), ([], [("p", 0, 64)])]


def test_admission_fills_free_slots_up_to_the_limit() -> None:
    assert admissible(running=2, waiting=10, max_batch=8, free_slots=6) == 6
    assert admissible(running=2, waiting=3, max_batch=8, free_slots=6) == 3
    assert admissible(running=6, waiting=3, max_batch=4, free_slots=2) == 0  # limit lowered
    assert admissible(running=0, waiting=3, max_batch=8, free_slots=0) == 0


def test_queued_leaves_out_what_the_next_step_admits() -> None:
    # the decode thread has not taken the first request yet, or it has: the same count
    assert queued(running=0, waiting=3, max_batch=1, free_slots=4) == 2
    assert queued(running=1, waiting=2, max_batch=1, free_slots=3) == 2
    assert queued(running=2, waiting=1, max_batch=8, free_slots=6) == 0
    assert queued(running=6, waiting=3, max_batch=4, free_slots=2) == 3  # limit lowered


def test_lowered_limit_pauses_the_newest() -> None:
    seqs = [decoding(c) for c in "abcde"]
    active, paused = split_active(seqs, 3)
    assert [s.name for s in active] == ["a", "b", "c"]
    assert [s.name for s in paused] == ["d", "e"]


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Policy(step_tokens=0)
    with pytest.raises(ValueError):
        Policy(chunk_tokens=0)
