"""Drafts from a second, smaller model (`engine.draftModel`, issue 48).

Where a request's text does not repeat its prompt, a small model of the same family guesses the
next tokens instead of the lookup (engines/speculative.py): the served model verifies them in its
own batch exactly as it verifies a lookup draft, so what a request gets does not change, only
how many tokens a step yields. The draft model runs on the decode thread, in its own context
with a KV cell range per sequence id, greedily (a point-mass proposal: drawing from the served
model and keeping the draft token while they agree keeps the served model's distribution).

Each step, per drafting sequence: the tokens its draft cells lack (the whole prompt the first
time, then the tokens kept since) in as few decodes as the batch allows, the last with logits;
then one decode per further draft token for all drafting sequences together. The draft tokens'
own cells are cleared afterwards, so the cells always hold the sequence's real tokens: the
tokens kept are decoded again at the next step, one batched call (simple and never stale).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ember_runtime import vocabulary
from ember_runtime.contract.config import DRAFT_BATCH_TOKENS
from ember_runtime.engines.base import EngineUnavailableError
from ember_runtime.engines.llama_native import LlamaContext, Row, Vocab

log = logging.getLogger("ember_runtime.engines.draft")


class _DecodeFailed(Exception):
    pass


@dataclass
class Want:
    """One sequence's request for a draft: its id, its tokens so far, how many to draft."""

    seq_id: int
    owner: object  # the sequence: an id reused by another request starts from no cells
    tokens: list[int]
    count: int


class DraftModel:
    def __init__(
        self,
        path: Path,
        *,
        served: Path,
        sequences: int,
        context_length: int,
        threads: int,
        gpu_layers: int,
        repack: bool,
    ) -> None:
        self.path, self._served = path, served
        self._ctx = LlamaContext(
            path,
            sequences=sequences,
            sequence_tokens=context_length,
            batch_tokens=DRAFT_BATCH_TOKENS,
            threads=threads,
            unified=True,
            gpu_layers=gpu_layers,
            repack=repack,
        )
        self._held: dict[int, tuple[object, int]] = {}  # seq id -> (owner, cells it holds)

    def open(self, served: Vocab) -> None:
        """Load the draft model (decode thread); refuse one whose vocabulary differs."""
        why = vocabulary.difference(self._served, self.path)
        if why is not None:
            raise EngineUnavailableError(f"draft model {why}")
        mine = self._ctx.open()
        if mine.size != served.size:  # the headers agreed; the loaded models must too
            raise EngineUnavailableError(
                f"draft model {self.path.name} loads {mine.size} tokens, the served {served.size}"
            )
        self._ctx.warm_up()

    def close(self) -> None:
        self._ctx.close()

    def step_seconds(self) -> float:
        """A one-row decode of the draft model: what each draft token costs it."""
        took = self._ctx.step_seconds(1)
        self._held.pop(0, None)  # the timing used sequence 0's cells
        return took

    def draft(self, wants: list[Want]) -> dict[int, list[int]]:
        """Up to `count` greedy tokens after each sequence's tokens, by seq id; none for any
        when a draft decode fails (its context full): drafts are an optimisation, and the step
        goes on without them, its cells cleared for a fresh start."""
        try:
            return self._draft(wants)
        except _DecodeFailed as err:
            log.warning("draft model: %s; this step drafts nothing", err)
            for w in wants:
                self._ctx.forget(w.seq_id)
                self._held.pop(w.seq_id, None)
            return {w.seq_id: [] for w in wants}

    def _draft(self, wants: list[Want]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {w.seq_id: [] for w in wants}
        self._catch_up(wants, out)
        live = list(wants)
        for depth in range(1, max((w.count for w in wants), default=0)):
            live = [w for w in live if len(out[w.seq_id]) == depth < w.count]
            if not live:
                break
            rows = [(out[w.seq_id][-1], len(w.tokens) + depth - 1, w.seq_id, True) for w in live]
            self._decode(rows)
            for i, w in enumerate(live):
                out[w.seq_id].append(self._greedy(i))
        for w in wants:  # the draft tokens' cells go: only real tokens stay
            self._ctx.forget(w.seq_id, len(w.tokens))
            self._held[w.seq_id] = (w.owner, len(w.tokens))
        return out

    def _catch_up(self, wants: list[Want], out: dict[int, list[int]]) -> None:
        """Decode what each sequence's cells lack, its last token with logits: its first draft
        token. Rows go in calls of `DRAFT_BATCH_TOKENS` (fewer where the context has fewer
        cells); a row's logits are read right after its call."""
        pending: list[Row] = []
        for w in wants:
            owner, held = self._held.get(w.seq_id, (None, 0))
            if owner is not w.owner:  # another request's cells
                self._ctx.forget(w.seq_id)
                held = 0
            elif held >= len(w.tokens):  # nothing new: the last token again, for its logits
                held = len(w.tokens) - 1
                self._ctx.forget(w.seq_id, held)
            last = len(w.tokens) - 1
            pending += [(w.tokens[p], p, w.seq_id, p == last) for p in range(held, len(w.tokens))]
        width = self._ctx.batch_limit()
        for start in range(0, len(pending), width):
            chunk = pending[start : start + width]
            self._decode(chunk)
            for i, (_, _, sid, last) in enumerate(chunk):
                if last:
                    out[sid].append(self._greedy(i))

    def _decode(self, rows: list[Row]) -> None:
        self._ctx.fill(rows)
        if (rc := self._ctx.decode()) != 0:
            raise _DecodeFailed(f"llama_decode returned {rc} for {len(rows)} rows")

    def _greedy(self, row: int) -> int:
        """The most likely next token after the last decode's `row`th row (batch index)."""
        return int(np.argmax(self._ctx.logits(row)))
