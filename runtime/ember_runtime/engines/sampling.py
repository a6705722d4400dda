"""Token choice from one logits row, exact and at engine speed (numpy; no model needed to test).

The distribution sampled from is llama-server's, in its order: logit bias (and `ignore_eos`) →
repetition penalties → [grammar mask] → top_k → typical_p → top_p → min_p → temperature →
draw. Every stage is exact; none sorts the whole vocabulary when it need not:

* **top_k** finds the k best by a threshold (estimated on a strided sample, one compare pass
  over the row, widened until it holds k) and sorts only those.
* **top_p** over the whole vocabulary needs the normaliser Z (one vectorised exp pass), then
  the nucleus is found in a growing top set (64, 512, 4,096 tokens, each a compare pass) whose
  mass reaches p·Z and only that set is sorted — Gemma 3's rows stop in the first or second.
  A flat row's nucleus (most of the vocabulary) becomes a floor on the logits, found by a
  galloping search of exact masked sums over a strided sample: never materialised or sorted.
* **min_p** is a threshold on logits (p ≥ min_p·p_max ⇔ l ≥ l_max + ln min_p), so it commutes
  with top_p and is one compare pass on a whole row.
* **no filter at all** (OpenAI's defaults: temperature 1, top_p 1) draws from the full softmax
  by inverse CDF over block sums: an exp pass, a sum per 1,024-token block, then one block's
  cumulative sum — no cumsum or sort over 262k tokens.

Penalties and logit bias touch only the tokens they name (a copy of the row, then sparse
updates). Log-probabilities are reported from the raw row: what the model thinks, before any
of this reshaped it (OpenAI reports the same).

Float detail: probabilities are computed in float64 from float32 logits (llama.cpp uses float32
throughout); a token on the exact top_p boundary may differ in a last-bit tie, nothing else.
Ties at a top_k or top_p boundary keep every tied token (llama.cpp keeps an arbitrary subset).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ember_runtime.engines.base import SamplingParams

_BLOCK = 1024  # inverse-CDF block for the unfiltered draw
_STRIDE_SAMPLE = 4096  # entries of a row read to estimate a top-set threshold
_TOP_SETS = (64, 512, 4096)  # top_p over a whole row: the best-token sets tried, then a floor

# (row) -> the same row with the tokens a grammar forbids at -inf (llama.cpp's grammar sampler)
GrammarMask = Callable[[np.ndarray], np.ndarray]


def greedy(row: np.ndarray) -> int:
    return int(row.argmax())


def logprobs(row: np.ndarray, chosen: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log softmax(row)[chosen] and the `top` most likely (token, logprob), best first.

    Computed from the raw logits: what the model thinks, before temperature, top_p or a
    grammar reshaped the distribution (OpenAI reports the same).
    """
    peak = float(row.max())
    norm = peak + float(np.log(np.exp(row.astype(np.float64) - peak).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, row.shape[0])
        idx = np.argpartition(row, -k)[-k:]
        idx = idx[np.argsort(row[idx])[::-1]]
        best = [(int(i), float(row[i]) - norm) for i in idx]
    return float(row[chosen]) - norm, best


@dataclass(frozen=True, slots=True)
class Candidates:
    """An explicit set of tokens and their logits, best first."""

    ids: np.ndarray  # int64
    logits: np.ndarray  # float64


class RowSampler:
    """One sequence's sampler: its RNG (seeded per request, so a seed's tokens do not depend on
    what shares the batch) and its penalty window (prompt tokens included, as llama-server's
    `common_sampler_accept` counts them, whether or not they came from the prefix cache)."""

    __slots__ = ("_bias", "_counts", "_grammar", "_rng", "_window", "params")

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        *,
        eog_tokens: Sequence[int] = (),
        grammar: GrammarMask | None = None,
    ) -> None:
        self.params = params
        self._rng = np.random.default_rng(None if params.seed is None else params.seed)
        self._grammar = grammar
        bias = dict(params.logit_bias)
        if params.ignore_eos:
            for tok in eog_tokens:
                bias[tok] = -math.inf
        self._bias = (
            (np.fromiter(bias, np.int64), np.fromiter(bias.values(), np.float32)) if bias else None
        )
        size = params.penalty_window
        self._window: collections.deque[int] | None = None
        self._counts: collections.Counter[int] = collections.Counter()
        if params.penalized and size:
            self._window = collections.deque(maxlen=size)
            for tok in prompt[-size:]:
                self.accept(tok)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw row: nothing reshapes it before the choice."""
        return self.params.greedy and not self._reshapes

    @property
    def _reshapes(self) -> bool:
        return self._bias is not None or self._window is not None or self._grammar is not None

    def accept(self, tok: int) -> None:
        """The token chosen (or a prompt token): into the penalty window."""
        window = self._window
        if window is None:
            return
        if len(window) == window.maxlen:
            old = window[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        window.append(tok)
        self._counts[tok] += 1

    def adjusted(self, row: np.ndarray) -> np.ndarray:
        """The row after logit bias, penalties and the grammar (a copy when any applies)."""
        if not self._reshapes:
            return row
        out = row.copy()
        if self._bias is not None:
            ids, add = self._bias
            out[ids] += add
        if self._counts:
            _penalize(out, self._counts, self.params)
        if self._grammar is not None:
            out = self._grammar(out)
        return out

    def sample(self, row: np.ndarray) -> int:
        """The next token from `row` (float32 logits), by the request's parameters."""
        logits = self.adjusted(row)
        if self.params.greedy:
            return int(logits.argmax())
        return draw(logits, self.params, self._rng)


def _penalize(out: np.ndarray, counts: collections.Counter[int], p: SamplingParams) -> None:
    """llama.cpp's penalties sampler, on the window's tokens only."""
    ids = np.fromiter(counts, np.int64, len(counts))
    n = np.fromiter(counts.values(), np.float32, len(counts))
    vals = out[ids]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
    vals = vals - n * p.frequency_penalty - (n > 0) * p.presence_penalty
    out[ids] = vals


def draw(row: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from the distribution that `p` defines over `row` (not greedy)."""
    cands = _filtered(row, p)
    if cands is None:  # nothing filters: the whole softmax at this temperature
        return _draw_index(row, p.temperature, rng)
    if isinstance(cands, float):  # every token at or above this logit
        return _draw_index(row, p.temperature, rng, floor=cands)
    return int(cands.ids[_draw_index(cands.logits, p.temperature, rng)])


# A candidate set: None is the whole row, a float every token at or above that logit (a large
# top set, never materialised), Candidates an explicit set.
CandidateSet = Candidates | float | None


def support(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The tokens the filters leave, in id order (tests check it against a reference)."""
    c = _filtered(row, p)
    if c is None:
        return np.arange(row.shape[0])
    if isinstance(c, float):
        return np.flatnonzero(row >= np.float32(c))
    return np.sort(c.ids)


def _filtered(row: np.ndarray, p: SamplingParams) -> CandidateSet:
    """top_k → typical_p → top_p → min_p, in llama-server's order; None when none applies."""
    keep = max(1, p.min_keep)
    cands: CandidateSet = None
    vocab = row.shape[0]
    if 0 < p.top_k < vocab:
        cands = _top_k(row, max(p.top_k, keep))
    if p.typical_p < 1.0:
        cands = _typical(_explicit(cands, row), p.typical_p, keep)
    if p.top_p < 1.0:
        cands = _top_p(cands, row, p.top_p, keep)
    if p.min_p > 0.0:
        cands = _min_p(cands, row, p.min_p, keep)
    return cands


def _explicit(c: CandidateSet, row: np.ndarray) -> Candidates:
    if isinstance(c, Candidates):
        return c
    floor = -math.inf if c is None else c
    return _sorted(np.flatnonzero(row >= np.float32(floor)), row)


def _sorted(ids: np.ndarray, row: np.ndarray) -> Candidates:
    vals = row[ids]
    order = np.argsort(vals, kind="stable")[::-1]
    return Candidates(ids[order].astype(np.int64), vals[order].astype(np.float64))


def top_set(row: np.ndarray, n: int) -> np.ndarray:
    """Indices of at least `n` tokens, closed upwards (every better token is in): all tokens at
    or above a threshold estimated from a strided sample, lowered until `n` are in."""
    vocab = row.shape[0]
    if n >= vocab:
        return np.arange(vocab)
    step = max(1, vocab // _STRIDE_SAMPLE)
    sample = row[::step]
    # Aim for ~2n tokens: the sample's rank that corresponds to 2n of the whole row.
    rank = min(len(sample) - 1, (2 * n) // step)
    while True:
        thr = np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank]
        ids = np.flatnonzero(row >= thr)
        if len(ids) >= n or rank >= len(sample) - 1:
            return ids if len(ids) >= n else np.arange(vocab)
        rank = min(len(sample) - 1, rank * 4 + 1)


def _top_k(row: np.ndarray, k: int) -> Candidates:
    cands = _sorted(top_set(row, k), row)
    return _cut(cands, k)


def _cut(c: Candidates, n: int) -> Candidates:
    """The first n, and every token tied with the n-th."""
    if n >= len(c.ids):
        return c
    last = c.logits[n - 1]
    n = int(np.searchsorted(-c.logits, -last, side="right"))
    return Candidates(c.ids[:n], c.logits[:n])


def _softmax(logits: np.ndarray) -> np.ndarray:
    w: np.ndarray = np.exp(logits - logits[0])
    w /= w.sum()
    return w


def _typical(c: Candidates, p: float, keep: int) -> Candidates:
    """llama.cpp's locally typical sampling on a sorted set."""
    probs = _softmax(c.logits)
    logp = np.log(np.where(probs > 0, probs, 1.0))
    entropy = -float((probs * logp).sum())
    shift = np.abs(-logp - entropy)
    order = np.argsort(shift, kind="stable")
    cum = np.cumsum(probs[order])
    n = max(keep, int(np.searchsorted(cum, p, side="right")) + 1)  # llama.cpp: cum > p
    chosen = order[: min(n, len(order))]
    chosen = np.sort(chosen)  # back to best-first
    return Candidates(c.ids[chosen], c.logits[chosen])


def _top_p(c: CandidateSet, row: np.ndarray, p: float, keep: int) -> CandidateSet:
    """The smallest best-first prefix whose probability reaches p (inclusive, as llama.cpp)."""
    if isinstance(c, Candidates):  # the set's own normaliser: it is all there is
        top = float(c.logits[0])
        return _nucleus(c, top, float(np.exp(c.logits - top).sum()), p, keep)
    assert c is None  # only top_k and typical_p come before, and both give explicit sets
    peak = float(row.max())
    w = np.exp(row - np.float32(peak))
    z = float(w.sum(dtype=np.float64))
    # Growing top sets: a real model's row ends in the first or second (Gemma 3 at top_p 0.95:
    # 31 to 1,900 tokens on story text), a flat one in none and gets a floor instead.
    for n in _TOP_SETS:
        ids = top_set(row, max(n, keep))
        if float(w[ids].sum(dtype=np.float64)) >= p * z:
            return _nucleus(_sorted(ids, row), peak, z, p, keep)
    return _floor(row, w, peak, p * z)


def _nucleus(c: Candidates, peak: float, z: float, p: float, keep: int) -> Candidates:
    """The top_p cut of a sorted set that holds the nucleus, against the normaliser z of what
    the set was drawn from (the whole row, or the set itself)."""
    cum = np.cumsum(np.exp(c.logits - peak)) / z
    n = max(keep, int(np.searchsorted(cum, p, side="left")) + 1)
    return _cut(c, min(n, len(c.ids)))


def _mass_above(row: np.ndarray, w: np.ndarray, floor: float) -> float:
    return float((w * (row >= np.float32(floor))).sum())  # pairwise float32: ~1e-7 relative


def _floor(row: np.ndarray, w: np.ndarray, peak: float, target: float) -> float:
    """The logit of a large nucleus's last token, returned as the set's floor (never
    materialised). A strided sample, sorted, guesses where the mass from the top reaches
    `target`; a galloping search over the sample's entries, each step one exact masked sum,
    finds the two neighbours it falls between; only the tokens between them are sorted."""
    step = max(1, row.shape[0] // _STRIDE_SAMPLE)
    sample = np.sort(row[::step])[::-1]
    size = len(sample)
    at = int(np.searchsorted(np.cumsum(np.exp(sample - np.float32(peak))) * step, target))

    def reaches(i: int) -> bool:  # the mass at or above sample[i] reaches the target
        return i >= size or _mass_above(row, w, float(sample[i])) >= target

    # Find hi < lo with reaches(lo) and not reaches(hi) (hi = -1: above the peak).
    at = min(at, size - 1)
    gap = 1
    if reaches(at):
        lo, hi = at, at - 1
        while hi >= 0 and reaches(hi):
            lo, hi, gap = hi, hi - gap * 2, gap * 2
    else:
        hi, lo = at, at + 1
        while not reaches(lo):
            hi, lo, gap = lo, lo + gap * 2, gap * 2
    while lo - hi > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if reaches(mid) else (lo, mid)
    top = math.nextafter(peak, math.inf) if hi < 0 else float(sample[hi])
    bottom = -math.inf if lo >= size else float(sample[lo])
    above = _mass_above(row, w, top)
    inside = np.flatnonzero((row >= np.float32(bottom)) & (row < np.float32(top)))
    vals = np.sort(row[inside].astype(np.float64))[::-1]
    cum = above + np.cumsum(np.exp(vals - peak))
    return float(vals[min(int(np.searchsorted(cum, target, side="left")), len(vals) - 1)])


def _min_p(c: CandidateSet, row: np.ndarray, p: float, keep: int) -> CandidateSet:
    if not isinstance(c, Candidates):
        floor = float(row.max()) + math.log(p)
        if c is not None:  # a large nucleus: the tighter of the two floors
            return max(floor, c)
        c = _explicit(floor, row)
        return c if len(c.ids) >= keep else _top_k(row, keep)
    thr = c.logits[0] + math.log(p)
    n = max(keep, int(np.searchsorted(-c.logits, -thr, side="right")))
    return Candidates(c.ids[:n], c.logits[:n])


def _draw_index(
    logits: np.ndarray, temperature: float, rng: np.random.Generator, *, floor: float | None = None
) -> int:
    """An index drawn from softmax(logits / T) over the logits at or above `floor`, by inverse
    CDF over block sums then one block's cumulative sum: no cumsum over a whole 262k row
    (numpy's is not vectorised)."""
    w = (logits - logits.max()).astype(np.float32)
    if temperature != 1.0:
        w *= np.float32(1.0 / temperature)
    np.exp(w, out=w)
    if floor is not None:
        w *= logits >= np.float32(floor)
    starts = np.arange(0, w.shape[0], _BLOCK)
    cum = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))
    target = rng.random() * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    rest = max(0.0, target - (cum[b - 1] if b else 0.0))
    inner = np.cumsum(w[starts[b] : starts[b] + _BLOCK], dtype=np.float64)
    return int(starts[b]) + min(int(np.searchsorted(inner, rest, side="right")), len(inner) - 1)
