"""Deterministic mode's promise at full width: 8 sequences at once equal their solo runs,
straight on the engine (no HTTP).

llama.cpp's CPU kernels may change at some ubatch width (8 rows on one x86 box here; another
CPU may differ), which only a wide batch shows. Deterministic mode never assumes that width:
it probes it at load, so these tests hold on any CPU whatever the probe finds. Prompts of 64+
tokens exercise the tiled attention path too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.engines.base import QueueFullError, SamplingParams
from ember_runtime.engines.llamacpp import LlamaCppEngine

from tests.runtime.test_generation import PROMPTS as HTTP_PROMPTS
from tests.support.waiting import wait_async

LONG = (  # 70+ tokens: llama.cpp attends over 64+ prompt rows with a tiled kernel
    "Write a long, detailed story about {}. Describe the setting, the weather, the sounds and "
    "the smells, introduce every character with care, give each of them a name, a job and a "
    "secret, use simple words and short sentences, and do not stop early. It was"
)
PROMPTS = [
    *HTTP_PROMPTS,
    LONG.format("a lighthouse keeper who finds a message in a bottle"),
    LONG.format("two rival bakers in a small northern town"),
    LONG.format("an astronaut repairing a satellite during a solar storm"),
]
TOKENS = 24


@contextlib.asynccontextmanager
async def running(model_path: Path, *, deterministic: bool) -> AsyncIterator[LlamaCppEngine]:
    # Started inside the test: the engine hands deltas to the loop it was started on.
    engine = LlamaCppEngine(
        model_path,
        context_length=256,
        capacity=8,
        threads=1,
        max_queue=16,
        step_tokens=64,  # prompts of 70+ tokens come in two chunks: the cut must not matter
        deterministic=deterministic,
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def greedy(engine: LlamaCppEngine, prompt: str, delay: float = 0.0) -> str:
    await asyncio.sleep(delay)
    stream = engine.submit(
        engine.tokenize(prompt, add_special=True), SamplingParams(max_tokens=TOKENS)
    )
    return "".join([delta.text async for delta in stream])


async def widest_step_while(engine: LlamaCppEngine, work: asyncio.Future[list[str]]) -> int:
    widest = 0
    while not work.done():
        widest = max(widest, engine.state().last_step_sequences)
        await asyncio.sleep(0.005)
    return widest


async def test_eight_at_once_match_their_solo_runs(model_path: Path) -> None:
    async with running(model_path, deterministic=True) as engine:
        assert 1 <= engine.exact_rows <= 8
        assert any(len(engine.tokenize(p, add_special=True)) >= 64 for p in PROMPTS)
        alone = [await greedy(engine, p) for p in PROMPTS]
        burst = asyncio.ensure_future(asyncio.gather(*(greedy(engine, p) for p in PROMPTS)))
        assert await widest_step_while(engine, burst) == 8
        assert await burst == alone
        # Joining one by one while the others decode: different neighbours at every step.
        late = [greedy(engine, p, 0.03 * i) for i, p in enumerate(PROMPTS)]
        assert await asyncio.gather(*late) == alone


async def test_fast_batching_serves_the_same_requests(model_path: Path) -> None:
    # Fast mode (the default) batches everything in one call per step with repacked weights:
    # it may round differently from a solo run (that is the trade-off), but every request
    # still gets its full answer, and the step really is one wide call.
    async with running(model_path, deterministic=False) as engine:
        assert engine.exact_rows == 0
        burst = asyncio.ensure_future(asyncio.gather(*(greedy(engine, p) for p in PROMPTS)))
        assert await widest_step_while(engine, burst) == 8
        together = await burst
        again = await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))
    assert all(text.strip() for text in together)
    assert len(again) == len(together)


@contextlib.asynccontextmanager
async def pooled(model_path: Path, seen: list[int]) -> AsyncIterator[LlamaCppEngine]:
    """A fast-mode engine on one KV pool that records each step's prompt tokens in `seen`."""
    engine = LlamaCppEngine(
        model_path,
        context_length=256,
        capacity=4,
        threads=1,
        max_queue=8,
        kv_unified=True,
        observer=lambda stats: seen.append(stats.prompt_tokens),
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_unified_pool_shares_a_running_prompt(model_path: Path) -> None:
    # One KV pool (kv_unified): a request whose prompt starts like a running one's takes those
    # cells (a seq_id tag, no copy) instead of recomputing them.
    seen: list[int] = []
    async with pooled(model_path, seen) as engine:
        head, tail = PROMPTS[5], " The first sentence is"
        shared = len(engine.tokenize(head, add_special=True))
        total = len(engine.tokenize(head + tail, add_special=True))
        tokens = engine.tokenize(head, add_special=True)
        first = engine.submit(tokens, SamplingParams(max_tokens=200))  # runs throughout
        what = "the first request's prompt in and its decoding started"
        await wait_async(what, lambda: engine.state().steps >= 2, 120, 0.005)
        second = await greedy(engine, head + tail)
        assert engine.state().active == 1, "the first request should still be running"
        first.cancel()
        assert second.strip()
        assert total > shared + 3
        assert sum(seen) == total  # the head once, then only the tail: not shared + total


async def test_copies_of_one_prompt_compute_it_once(model_path: Path) -> None:
    # n > 1 (or the same prompt again) submitted at once: the first computes the prompt, the
    # rest wait one prefill and share its cells, decoding only their last prompt token.
    seen: list[int] = []
    async with pooled(model_path, seen) as engine:
        tokens = engine.tokenize(PROMPTS[5], add_special=True)
        params = SamplingParams(max_tokens=3, temperature=1.0)
        streams = [engine.submit(tokens, params) for _ in range(4)]  # all queued in one go

        async def drain(stream: Any) -> list[Any]:
            return [delta async for delta in stream]

        outs = await asyncio.gather(*(drain(s) for s in streams))
        assert all(out[-1].finish_reason is not None for out in outs)
        assert len(tokens) > 20
        assert sum(seen) == len(tokens) + 3  # once, then one token per copy: not 4 x


async def test_queue_bound_does_not_count_a_request_a_free_slot_takes(model_path: Path) -> None:
    # One slot, two queued: the third submit in a row is accepted whether or not the decode
    # thread has taken the first yet (it counted as queued, so bursts got a spurious 429).
    engine = LlamaCppEngine(model_path, context_length=256, capacity=4, threads=1, max_queue=2)
    await engine.start()
    engine.set_max_batch_size(1)
    try:
        tokens = engine.tokenize(PROMPTS[0], add_special=True)
        params = SamplingParams(max_tokens=4)
        streams = [engine.submit(tokens, params) for _ in range(3)]  # no await in between
        with pytest.raises(QueueFullError):
            engine.submit(tokens, params)
        for stream in streams:
            assert "".join([delta.text async for delta in stream])
    finally:
        await engine.stop()
