"""One step's tokens in the llama.cpp engine: each output row's token, drawn inside
`llama_decode` by the sequence's device chain (engines/device_sampling.py) or on the host from
its logits row (engines/sampling.py's chain, which holds the one order of the stages). Host
draws that need more than an argmax go to a thread pool where the CPU has cores to spare."""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

from ember_runtime.engines import sampling
from ember_runtime.engines.base import EngineError
from ember_runtime.engines.llama_native import LlamaContext
from ember_runtime.engines.slots import Sequence

# Rows are drawn on a pool only where this many cores are spare; at most this many threads.
_MIN_SAMPLER_THREADS = 2
_MAX_SAMPLER_THREADS = 8

# A sequence, its token, and the logits row it was drawn from (None: drawn on the device).
Drawn = tuple[Sequence, int, np.ndarray | None]


class Drawer:
    """Draws the tokens of each decode's output rows; counts those drawn on the device."""

    def __init__(self, native: LlamaContext, pool: concurrent.futures.Executor | None) -> None:
        self._native = native
        self._pool = pool
        self.device_rows = 0  # tokens drawn inside llama_decode (device chains) so far

    def tokens(self, outputs: list[tuple[Sequence, int]]) -> list[Drawn]:
        """Each (sequence, output row)'s token: drawn in the decode (a device chain) or here
        from its logits row. llama.cpp copies the logits to the host only when some row needs
        them."""
        native = self._native
        picked: list[Drawn] = []
        host: list[tuple[Sequence, np.ndarray]] = []
        for seq, idx in outputs:
            if seq.chain is None:
                host.append((seq, native.logits(idx)))
                continue
            tok = seq.chain.token(native.ctx, idx)
            if tok < 0:  # the chain ran nowhere: a llama.cpp invariant broke
                raise EngineError(f"llama.cpp drew no token for sequence {seq.seq_id}")
            picked.append((seq, tok, None))
        self.device_rows += len(picked)
        if host:
            chosen = self._choose([seq for seq, _ in host], [row for _, row in host])
            picked += [(seq, tok, row) for (seq, row), tok in zip(host, chosen, strict=True)]
        return picked

    def _choose(self, seqs: list[Sequence], rows: list[np.ndarray]) -> list[int]:
        """Each row's token. Rows that need more than an argmax go to the sampler pool where
        there is one (spare cores: numpy's passes release the GIL), else in turn here."""
        picks: list[int | None] = [
            sampling.greedy(row) if seq.sampler.plain_greedy else None
            for seq, row in zip(seqs, rows, strict=True)
        ]
        todo = [i for i, tok in enumerate(picks) if tok is None]
        if self._pool is not None and len(todo) > 1:
            drawn = list(self._pool.map(lambda i: seqs[i].sampler.sample(rows[i]), todo))
        else:
            drawn = [seqs[i].sampler.sample(rows[i]) for i in todo]
        for i, tok in zip(todo, drawn, strict=True):
            picks[i] = tok
        return [int(tok) for tok in picks if tok is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def sampler_pool(
    engine_threads: int, wanted: int | None
) -> concurrent.futures.ThreadPoolExecutor | None:
    """Threads that draw a step's rows in parallel (numpy's passes release the GIL), or None:
    the draws then run one after another on the decode thread. `wanted` None takes the cores
    llama.cpp's threads leave spare (a GPU host: a 64-row step's draws would otherwise queue),
    up to 8, and none on a small CPU box."""
    if wanted is None:
        spare = len(os.sched_getaffinity(0)) - engine_threads
        wanted = min(spare, _MAX_SAMPLER_THREADS) if spare >= _MIN_SAMPLER_THREADS else 0
    if wanted <= 1:
        return None
    return concurrent.futures.ThreadPoolExecutor(wanted, thread_name_prefix="ember-sample")
