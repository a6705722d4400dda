"""Prompt-lookup drafting and its off-switch (engines/speculative.py), without a model: what a
sequence drafts from its own tokens, how the draft length adapts, and that a sequence whose
drafts keep failing stops drafting for a while, then tries again."""

from __future__ import annotations

import pytest
from ember_runtime.contract.config import SpeculationConfig
from ember_runtime.engines.speculative import (
    MAX_PAUSE_TOKENS,
    PAUSE_TOKENS,
    NgramIndex,
    SpecSettings,
    Speculator,
    shared_cost,
)


def test_the_longest_suffix_seen_before_drafts_what_followed_it() -> None:
    # "1 2 3 4 5 6 ... 1 2 3" -> the last time "1 2 3" was seen, "4 5 6" followed.
    index = NgramIndex([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], ngram_min=2, ngram_max=4)
    assert index.draft(3) == [4, 5, 6]
    assert index.draft(10) == [4, 5, 6, 9, 1, 2, 3]  # up to the end of what is known


def test_the_latest_occurrence_wins_and_longer_suffixes_first() -> None:
    # "7 8" was followed by 1 first and by 2 later: the later one drafts.
    index = NgramIndex([7, 8, 1, 0, 7, 8, 2, 0, 7, 8], ngram_min=2, ngram_max=2)
    assert index.draft(1) == [2]
    # A longer suffix "5 7 8" matches the first occurrence only: it is tried before "7 8".
    index = NgramIndex([5, 7, 8, 1, 0, 7, 8, 2, 0, 5, 7, 8], ngram_min=2, ngram_max=3)
    assert index.draft(1) == [1]


def test_no_earlier_occurrence_no_draft() -> None:
    assert NgramIndex([1, 2, 3, 4, 5], ngram_min=2, ngram_max=4).draft(8) == []
    assert NgramIndex([], ngram_min=2, ngram_max=4).draft(8) == []


def test_appended_tokens_are_looked_up_as_the_prompt_is() -> None:
    index = NgramIndex([10, 11, 12, 13], ngram_min=2, ngram_max=3)
    for tok in (10, 11):
        index.append(tok)
    assert index.draft(2) == [12, 13]
    index.append(12)
    assert index.draft(2) == [13, 10]


def test_a_sequence_whose_drafts_fail_pauses_then_tries_again() -> None:
    settings = SpecSettings(max_draft=8, ngram_min=2, ngram_max=3)
    spec = Speculator([1, 2, 3, 4, 1, 2, 3], settings, cost=0.3)
    generated = 1
    assert spec.length() >= 2  # before any draft: the prior, a fair chance
    assert spec.propose(generated, 8) == [4, 1, 2, 3][: spec.length()]
    # Every draft missed at its first token: drafts shorten, then drafting pauses.
    lengths = []
    while not spec.paused(generated):
        draft = spec.propose(generated, 8)
        assert draft
        lengths.append(len(draft))
        spec.record(len(draft), 0, generated)
        generated += 1
    assert lengths == sorted(lengths, reverse=True)
    assert len(lengths) <= 3
    assert spec.pauses == 1
    assert spec.propose(generated, 8) == []
    # The pause lasts PAUSE_TOKENS generated tokens; a failure after it pauses twice as long.
    resume = generated - 1 + PAUSE_TOKENS
    assert spec.propose(resume - 1, 8) == []
    assert spec.propose(resume, 8)
    generated = resume
    while not spec.paused(generated):
        spec.record(1, 0, generated)
        generated += 1
    assert spec.pauses == 2
    assert not spec.paused(generated - 1 + 2 * PAUSE_TOKENS)
    assert spec.paused(generated - 2 + 2 * PAUSE_TOKENS)


def test_the_pause_is_bounded_and_drafts_that_pay_keep_it_short() -> None:
    spec = Speculator([1, 2, 1, 2], SpecSettings(max_draft=4), cost=0.5)
    generated = 0
    for _ in range(20):  # many failed retries: the pause stops doubling at its bound
        start = generated
        while not spec.paused(generated):
            spec.record(4, 0, generated)
            generated += 1
        pause = spec._resume_at - (generated - 1)
        assert pause <= MAX_PAUSE_TOKENS
        generated = start + 1 + pause + 1
    assert pause == MAX_PAUSE_TOKENS
    spec.record(4, 4, generated)  # a draft kept whole: the next pause is short again
    while not spec.paused(generated):
        spec.record(4, 0, generated)
        generated += 1
    assert spec._resume_at - (generated - 1) == PAUSE_TOKENS


def _with_history(kept: int, cost: float) -> Speculator:
    """A sequence that, draft after draft, kept `kept` tokens and then missed one."""
    spec = Speculator([], SpecSettings(max_draft=32), cost=cost)
    for _ in range(40):
        spec.record(kept + 1, kept, 0)
    assert spec.pauses == 0
    assert spec.acceptance == pytest.approx(kept / (kept + 1), abs=0.01)
    return spec


def test_the_draft_length_pays_best_at_this_acceptance_and_row_cost() -> None:
    """Long drafts where nearly all is kept or rows are cheap (a GPU), short where it misses."""
    cpu = 0.25  # a draft row's share of a one-row step on the 2-core box (Gemma 3 270M)
    assert 6 <= _with_history(19, cpu).length() <= 12  # keeps 95%
    assert _with_history(19, 0.02).length() >= 24  # the same on a GPU
    assert _with_history(1, cpu).length() <= 3  # keeps half
    lengths = [_with_history(k, cpu).length() for k in (1, 3, 9, 19, 99)]
    assert lengths == sorted(lengths)
    costs = [_with_history(9, c).length() for c in (0.02, 0.1, 0.25, 0.5)]
    assert costs == sorted(costs, reverse=True)


def test_a_draft_that_pays_alone_pauses_in_a_shared_step() -> None:
    """Beside other streams a sequence's own token is cheaper, a draft row is not: a third of
    the draft tokens it reaches kept pays alone (row cost 0.15), not beside three others (41 %)."""
    assert shared_cost(0.15, 1) == pytest.approx(0.15)
    assert shared_cost(0.15, 4) == pytest.approx(0.6 / 1.45)
    costs = [shared_cost(0.15, n) for n in (1, 2, 4, 16, 64)]
    assert costs == sorted(costs) and costs[-1] < 1.0
    verdicts = {}
    for sequences in (1, 4):
        spec = Speculator([1, 2, 3, 1, 2, 3, 1, 2, 3], SpecSettings(max_draft=3), cost=0.15)
        for generated in range(12):  # one token kept, then none: a third of those reached
            if spec.propose(generated, 3, sequences):
                spec.record(3, 1 - generated % 2, generated)
        verdicts[sequences] = spec.pauses
    assert verdicts == {1: 0, 4: 1}


def test_drafts_that_are_kept_grow_long() -> None:
    tokens = list(range(40)) * 2
    spec = Speculator(tokens[:-30], SpecSettings(max_draft=8, ngram_max=4), cost=0.1)
    spec.record(1, 0, 1)  # one miss: short drafts for now
    short = len(spec.propose(2, 32))
    for _ in range(6):
        spec.record(8, 8, 2)
    assert len(spec.propose(3, 32)) == 8 > short
    assert len(spec.propose(3, 3)) == 3  # never past the engine's limit for the step


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ngramMin": 5, "ngramMax": 3}, "ngramMin must not exceed ngramMax"),
        ({"maxDraft": 0}, "greater than or equal to 1"),
    ],
)
def test_the_config_refuses_what_cannot_work(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculationConfig.model_validate(fields)


def test_draft_rows_are_budgeted_only_where_the_engine_drafts() -> None:
    config = SpeculationConfig.model_validate({"maxDraft": 6, "sequences": 2})
    assert config.draft_rows() == 12
    assert config.draft_rows(deterministic=True) == 0
    assert config.draft_rows(kind="tensorrt-llm") == 0
    off = SpeculationConfig.model_validate({"mode": "off"})
    assert off.draft_rows() == 0
