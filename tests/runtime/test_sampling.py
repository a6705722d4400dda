"""The numpy sampler against an independent float64 reference (no model: synthetic rows).

For each parameter set and row shape: the candidate set equals the reference's exactly, and
10,000 draws fit the reference distribution (chi-square; a case fails below p = 1e-6, i.e. a
correct sampler fails one case in a million runs). Rows are peaked (a real model's shape: the
nucleus is a few dozen tokens), medium (hundreds) and flat (a random-weight model: most of the
vocabulary), so every path of `sampling._top_p` runs. Penalties, logit bias and ignore_eos are
checked token by token; a seed gives the same tokens whatever else is drawn.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from ember_runtime.engines import sampling
from ember_runtime.engines.base import SamplingParams

VOCAB = 32_768
DRAWS = 10_000
P_FLOOR = 1e-6


def _row(shape: str, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "peaked":  # a few strong tokens over a long low tail
        row = rng.standard_normal(VOCAB) * 2.0
        row[rng.choice(VOCAB, 12, replace=False)] += rng.uniform(8, 14, 12)
    elif shape == "medium":
        row = rng.standard_normal(VOCAB) * 4.0
    else:  # flat
        row = rng.standard_normal(VOCAB)
    return row.astype(np.float32)


def reference(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """llama.cpp's chain written out over the whole vocabulary, sorted, in float64: the
    probability of every token."""
    logits = row.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    vals = logits[order]
    keep = max(1, p.min_keep)
    if 0 < p.top_k < len(vals):
        order, vals = order[: p.top_k], vals[: p.top_k]
    if p.typical_p < 1.0:
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        entropy = -float((probs * np.log(probs)).sum())
        by_shift = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")
        total, n = 0.0, len(vals)
        for i, j in enumerate(by_shift):
            total += probs[j]
            if total > p.typical_p and i + 1 >= keep:
                n = i + 1
                break
        chosen = np.sort(by_shift[:n])
        order, vals = order[chosen], vals[chosen]
    if p.top_p < 1.0:
        probs = np.exp(vals - vals[0])
        cum = np.cumsum(probs / probs.sum())
        n = next(i + 1 for i, c in enumerate(cum) if c >= p.top_p and i + 1 >= keep)
        order, vals = order[:n], vals[:n]
    if p.min_p > 0.0:
        n = max(keep, int((vals >= vals[0] + math.log(p.min_p)).sum()))
        order, vals = order[:n], vals[:n]
    weights = np.exp((vals - vals[0]) / p.temperature)
    out = np.zeros(len(row))
    out[order] = weights / weights.sum()
    return out


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square, bins with fewer than 5 expected merged into one
    (Wilson-Hilferty's approximation of the chi-square tail)."""
    big = expected >= 5
    obs = [*counts[big], counts[~big].sum()]
    exp = [*expected[big], expected[~big].sum()]
    if exp[-1] < 5:  # too small to stand alone: fold into the smallest real bin
        smallest = int(np.argmin(exp[:-1]))
        obs[smallest] += obs.pop()
        exp[smallest] += exp.pop()
    o, e = np.array(obs, float), np.array(exp, float)
    dof = len(e) - 1
    if dof < 1:
        return 1.0
    x = float(((o - e) ** 2 / e).sum())
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


CASES = [
    ("peaked", {"temperature": 0.8, "top_p": 0.95}),
    ("medium", {"temperature": 0.8, "top_p": 0.95}),
    ("flat", {"temperature": 0.8, "top_p": 0.95}),
    ("peaked", {"temperature": 1.0}),
    ("flat", {"temperature": 1.0}),
    ("flat", {"temperature": 0.6}),
    ("peaked", {"temperature": 0.7, "top_k": 12}),
    ("medium", {"temperature": 1.3, "top_k": 50, "top_p": 0.9, "min_p": 0.02}),
    ("flat", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
    ("medium", {"temperature": 0.9, "min_p": 0.1}),
    ("flat", {"temperature": 0.9, "top_p": 0.9, "min_p": 0.3}),
    ("medium", {"temperature": 0.9, "typical_p": 0.8}),
    ("medium", {"temperature": 1.0, "top_p": 0.5, "min_keep": 40}),
]


@pytest.mark.parametrize(("shape", "kw"), CASES, ids=[f"{s}-{kw}" for s, kw in CASES])
def test_draws_fit_the_distribution_the_parameters_define(shape: str, kw: dict[str, float]) -> None:
    row = _row(shape)
    params = SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]
    expected = reference(row, params)
    assert np.array_equal(sampling.support(row, params), np.flatnonzero(expected > 0))
    sampler = sampling.RowSampler(params, [], grammar=None)
    counts = np.bincount([sampler.sample(row) for _ in range(DRAWS)], minlength=VOCAB)
    assert not counts[expected == 0].any(), "a token outside the candidate set was drawn"
    assert chi_square_p(counts, expected * DRAWS) > P_FLOOR


def test_the_chi_square_check_rejects_a_wrong_distribution() -> None:
    """The check has teeth: draws at temperature 0.8 do not pass as temperature 1."""
    row = _row("peaked")
    drawn = sampling.RowSampler(SamplingParams(max_tokens=1, temperature=0.8), [])
    counts = np.bincount([drawn.sample(row) for _ in range(DRAWS)], minlength=VOCAB)
    wrong = reference(row, SamplingParams(max_tokens=1, temperature=1.0))
    assert chi_square_p(counts, wrong * DRAWS) < P_FLOOR


def test_penalties_move_exactly_the_window_tokens() -> None:
    row = _row("medium")
    row[5], row[6] = -3.0, 3.0  # llama.cpp multiplies a negative logit, divides a positive one
    prompt = [1, 2, 3, 3, 5, 6, 6, 6]
    params = SamplingParams(
        max_tokens=1,
        temperature=1.0,
        repeat_penalty=1.5,
        repeat_last_n=7,  # the first prompt token falls out of the window
        presence_penalty=0.25,
        frequency_penalty=0.5,
    )
    sampler = sampling.RowSampler(params, prompt)
    sampler.accept(2)  # a generated token joins the window; prompt token 2 (the second) leaves
    out = sampler.adjusted(row)
    counts = {3: 2, 5: 1, 6: 3, 2: 1}  # window: [3, 3, 5, 6, 6, 6, 2]
    for tok, n in counts.items():
        base = row[tok] * 1.5 if row[tok] <= 0 else row[tok] / 1.5
        assert out[tok] == pytest.approx(base - n * 0.5 - 0.25, rel=1e-6), tok
    untouched = np.setdiff1d(np.arange(VOCAB), list(counts))
    assert np.array_equal(out[untouched], row[untouched])
    assert out is not row and row[6] == 3.0  # the raw row (logprobs read it) is left alone


def test_logit_bias_and_ignore_eos_move_only_their_tokens() -> None:
    row = _row("peaked")
    params = SamplingParams(
        max_tokens=1, temperature=0.0, logit_bias=((10, 5.0), (11, -math.inf)), ignore_eos=True
    )
    out = sampling.RowSampler(params, [], eog_tokens=(1, 106)).adjusted(row)
    assert out[10] == pytest.approx(row[10] + 5.0)
    assert out[11] == -math.inf and out[1] == -math.inf and out[106] == -math.inf
    rest = np.setdiff1d(np.arange(VOCAB), [1, 10, 11, 106])
    assert np.array_equal(out[rest], row[rest])


def test_bias_and_penalties_apply_to_greedy_too() -> None:
    row = _row("peaked")
    best = int(row.argmax())
    banned = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((best, -math.inf),))
    sampler = sampling.RowSampler(banned, [])
    assert not sampler.plain_greedy
    assert sampler.sample(row) == int(np.argsort(row)[-2])


def test_a_seed_gives_the_same_tokens_whatever_is_drawn_beside_it() -> None:
    rows = [_row(shape, seed) for seed in range(6) for shape in ("peaked", "flat")]
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95, seed=1234)
    alone = sampling.RowSampler(params, [])
    first = [alone.sample(r) for r in rows]
    again, other = sampling.RowSampler(params, []), sampling.RowSampler(params, [])
    mixed = []
    for r in rows:  # another sequence with the same seed draws in between
        mixed.append(again.sample(r))
        other.sample(r[::-1].copy())
    assert mixed == first
    reseeded = sampling.RowSampler(SamplingParams(max_tokens=1, temperature=1.0, seed=99), [])
    assert [reseeded.sample(r) for r in rows] != first


def test_top_set_holds_the_best_tokens() -> None:
    for shape in ("peaked", "medium", "flat"):
        row = _row(shape)
        for n in (1, 40, 700, VOCAB):
            got = sampling.top_set(row, n)
            assert len(got) >= n
            # closed upwards: every token at least as good as the set's worst is in it
            assert np.array_equal(np.sort(got), np.flatnonzero(row >= row[got].min()))


def test_the_sampler_pool_takes_spare_cores_only() -> None:
    from ember_runtime.engines.draw import sampler_pool

    cores = len(os.sched_getaffinity(0))
    assert sampler_pool(cores, None) is None  # llama.cpp's threads take every core
    assert sampler_pool(1, 0) is None  # switched off
    pool = sampler_pool(cores, 3)  # asked for: three threads whatever the cores
    assert pool is not None and pool._max_workers == 3
    pool.shutdown()


def test_logprobs_are_a_log_softmax_with_the_best_first() -> None:
    row = np.array([1.0, 3.0, 2.0, 3.0 - np.log(2.0)], dtype=np.float32)
    chosen, top = sampling.logprobs(row, 2, 2)
    total = np.log(np.exp(row.astype(np.float64)).sum())
    assert chosen == pytest.approx(2.0 - total, abs=1e-6)
    assert [t for t, _ in top] == [1, 3]
    assert top[0][1] - top[1][1] == pytest.approx(np.log(2.0), abs=1e-6)
    assert sampling.logprobs(row, 0, 0)[1] == []
    assert sampling.greedy(row) == 1
