"""Speculative decoding with drafts from the request's own text (issue 48): prompt lookup.

A sequence that has generated a few tokens looks up its last n tokens (n from `ngram_max`
down to `ngram_min`) earlier in its prompt and output; where they occurred before, the tokens
that followed then are its draft. The engine decodes the last token and the draft in the same
`llama_decode` as the other sequences' rows, with logits for each, and draws each position in
turn with the request's own sampler (`LlamaCppEngine._verify`): a draft token is kept while the
drawn token equals it, and the first drawn token that differs ends the run (it is kept as the
correction). Code edits, RAG answers and summaries repeat their prompt: most of such a reply
comes several tokens per step.

Why drawing and comparing keeps the distribution: a lookup draft is one token with probability
1 (q = a point mass on d). Speculative sampling accepts d with probability min(1, p(d)/q(d)) =
p(d), and on a rejection draws from max(0, p - q) normalised, which is p without d. Drawing
x ~ p and keeping d when x == d does both at once: d is kept with probability p(d), and an x
that differs is distributed as p conditioned on x != d. Greedy is the same with p an argmax, so
greedy text is token for token the text without speculation (where the logits of a row do not
depend on how many rows share the call; `tests/runtime/test_speculative_model.py`). One draw per
emitted token, as without speculation: a seeded request draws the same numbers.

Where it does not pay it turns itself off: each extra row costs `row_cost` of a one-row step
(measured at load, `LlamaContext.row_cost`), so alone a draft pays while more than that share
of its tokens are kept. In a step of n decoding sequences the bar is higher (`shared_cost`): a
step of n rows costs 1 + c(n - 1) one-row steps, so each sequence's own token costs
(1 + c(n - 1)) / n of them while a draft row still costs c; a draft row that keeps less than
c n / (1 + c(n - 1)) of a token slows the batch more than it gives (at c = 0.15: 15 % alone,
41 % at 4 sequences). A sequence whose recent acceptance falls below that pauses
drafting for a while (longer after each pause that did not help) and tries again. Above it,
the draft's length is the one that yields the most tokens per unit of work (`Speculator.length`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# How far back acceptance is counted: each step's counts weigh this much less at the next.
_DECAY = 0.8
# What a sequence is assumed to keep before its first draft, and after a pause (weight 1 step).
_PRIOR = 0.8
# The acceptance floor is the measured cost of a draft row, kept within these bounds.
FLOOR_BOUNDS = (0.05, 0.9)
# The first pause, in generated tokens, and the longest (each failed retry doubles it).
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """What the engine speculates with (`engine.speculation` in the runtime config)."""

    max_draft: int = 8  # tokens drafted per step at most
    ngram_min: int = 2  # the shortest suffix looked up
    ngram_max: int = 4  # the longest suffix looked up (tried first)
    sequences: int = 4  # sequences that may draft in one step (their rows are budgeted)
    # A draft row's work as a share of a one-row step; None: timed at load (`row_cost`). Fixed,
    # the draft lengths (and so the batch shapes and their last bits) no longer vary by run.
    row_cost: float | None = None
    # A smaller model with the same vocabulary drafts instead of the lookup (engines/draft.py).
    draft_model: Path | None = None

    @property
    def draft_rows(self) -> int:
        """Rows one step may spend on drafts (the context's output budget grows by this)."""
        return self.max_draft * self.sequences


class NgramIndex:
    """Where each n-gram of a token list last occurred with a known next token."""

    __slots__ = ("_last", "_nmax", "_nmin", "tokens")

    def __init__(self, tokens: list[int], ngram_min: int, ngram_max: int) -> None:
        self.tokens: list[int] = []
        self._nmin, self._nmax = ngram_min, ngram_max
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        for tok in tokens:
            self.append(tok)

    def append(self, tok: int) -> None:
        """Add a token; the n-grams ending just before it now have a next token (this one)."""
        toks = self.tokens
        end = len(toks)
        for n in range(self._nmin, min(self._nmax, end) + 1):
            self._last[tuple(toks[end - n : end])] = end
        toks.append(tok)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix's last earlier occurrence."""
        toks = self.tokens
        end = len(toks)
        for n in range(min(self._nmax, end), self._nmin - 1, -1):
            at = self._last.get(tuple(toks[end - n : end]))
            if at is not None:
                return toks[at : at + limit]
        return []


def shared_cost(row_cost: float, sequences: int) -> float:
    """A draft row's work as a share of one sequence's part of a step of `sequences` rows."""
    n = max(1, sequences)
    return row_cost * n / (1 + row_cost * (n - 1))


class Speculator:
    """One sequence's drafting: its index, the share of draft tokens it keeps, its pauses.

    The share is a per-token estimate, a: of the draft tokens it reached, how many were kept (a
    draft stops at its first miss, so the tokens after a miss are not counted against it). A
    draft of d tokens then yields (1 - a^(d+1)) / (1 - a) tokens for 1 + cost x d rows' work,
    and the sequence drafts the length that maximises that rate (long drafts where it keeps
    nearly everything or rows are cheap, as on a GPU; short ones where it misses)."""

    __slots__ = (
        "_kept",
        "_pause",
        "_reached",
        "_resume_at",
        "_row_cost",
        "_sequences",
        "_settings",
        "accepted",
        "drafted",
        "index",
        "pauses",
    )

    def __init__(self, tokens: list[int], settings: SpecSettings, cost: float) -> None:
        self.index = NgramIndex(tokens, settings.ngram_min, settings.ngram_max)
        self._settings = settings
        self._row_cost = cost  # one draft row's work, as a share of a one-row step's
        self._sequences = 1  # decoding sequences in the step last drafted for: prices its rows
        self._kept, self._reached = _PRIOR, 1.0
        self._pause = PAUSE_TOKENS
        self._resume_at = 0  # generated-token count at which drafting may start again
        self.drafted = self.accepted = self.pauses = 0

    @property
    def acceptance(self) -> float:
        return self._kept / self._reached

    def length(self) -> int:
        """The draft length that yields the most tokens per unit of work at this acceptance."""
        a, cost = min(self.acceptance, 0.999), self._cost
        best, best_rate = 1, 0.0
        for d in range(1, self._settings.max_draft + 1):
            rate = (1 - a ** (d + 1)) / (1 - a) / (1 + cost * d)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    @property
    def _cost(self) -> float:
        """A draft row's price in the step last drafted for (`shared_cost`)."""
        return shared_cost(self._row_cost, self._sequences)

    @property
    def _floor(self) -> float:
        """The acceptance below which drafting pauses: the row's price, within bounds."""
        return min(max(self._cost, FLOOR_BOUNDS[0]), FLOOR_BOUNDS[1])

    def wanted(self, generated: int, limit: int, sequences: int = 1) -> int:
        """How many tokens to draft this step, beside `sequences` decoding sequences in all:
        none while paused."""
        self._sequences = sequences
        if self.paused(generated) or limit <= 0:
            return 0
        return min(limit, self.length())

    def propose(self, generated: int, limit: int, sequences: int = 1) -> list[int]:
        """The lookup draft for this step (empty while paused or where nothing matches)."""
        return self.index.draft(self.wanted(generated, limit, sequences))

    def record(self, drafted: int, accepted: int, generated: int) -> None:
        """How a draft fared: pause where drafting does not pay."""
        self.drafted += drafted
        self.accepted += accepted
        missed = 1 if accepted < drafted else 0
        self._kept = _DECAY * self._kept + accepted
        self._reached = _DECAY * self._reached + accepted + missed
        if self.acceptance < self._floor:
            self.pauses += 1
            self._resume_at = generated + self._pause
            self._pause = min(MAX_PAUSE_TOKENS, self._pause * 2)
            self._kept, self._reached = _PRIOR, 1.0  # a fresh chance after the pause
        elif accepted > 0:
            self._pause = PAUSE_TOKENS  # drafting pays here again: the next pause is short

    def paused(self, generated: int) -> bool:
        return generated < self._resume_at
