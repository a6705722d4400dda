"""Sampling on the real Gemma model through the engine's own path (decode, `_choose`, draw).

The engine runs deterministic (`engine.deterministic`): every request of one prompt then gets
bit-identical logits, so many one-token requests are many draws from one distribution. The
expected distribution is computed here, in float64, from the model's raw log-probabilities of
the 20 most likely tokens (each reply carries them, and the test checks they agree), for
parameter sets whose candidates all lie in those 20; the rest of the vocabulary is one bin
where nothing filters. A case fails below p = 1e-6 (chi-square, as in test_sampling.py).

Both sampling paths are tested: the host sampler (numpy, `sampling.py`) and llama.cpp's chain
inside `llama_decode` (`device_sampling.py`, here on the CPU backend: the same graph ops a GPU
runs). A device-sampled reply carries no logprobs (they need the raw row on the host), so on
that path one host request with logprobs gives the reference and the draws are counted by text.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from ember_runtime.engines.base import SamplingParams
from ember_runtime.engines.device_sampling import DeviceSampling
from ember_runtime.engines.llamacpp import LlamaCppEngine

from tests.runtime.test_sampling import P_FLOOR, chi_square_p

PROMPT = "Monday, Tuesday, Wednesday,"  # peaked: the top 20 hold 98.6%
DRAWS = 600
TOP = 20


PATHS = [DeviceSampling.OFF, DeviceSampling.ON]
PATH_IDS = ["host", "device"]


@contextlib.asynccontextmanager
async def running(
    model_path: Path, path: DeviceSampling = DeviceSampling.OFF
) -> AsyncIterator[LlamaCppEngine]:
    engine = LlamaCppEngine(
        model_path,
        context_length=64,
        capacity=8,
        threads=1,
        max_queue=DRAWS,
        deterministic=True,
        device_sampling=path,
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def first_tokens(
    engine: LlamaCppEngine, params: SamplingParams, n: int
) -> tuple[Counter[bytes], list[tuple[bytes, float]]]:
    """n one-token requests: the count of each token drawn, and the top-20 raw logprobs."""
    prompt = engine.tokenize(PROMPT, add_special=True)
    tops: set[tuple[tuple[bytes, float], ...]] = set()
    drawn: Counter[bytes] = Counter()

    async def one() -> None:
        async for delta in engine.submit(prompt, params):
            if delta.logprobs:
                lp = delta.logprobs[0]
                drawn[lp.token_bytes] += 1
                tops.add(tuple((t.token_bytes, t.logprob) for t in lp.top))

    await asyncio.gather(*(one() for _ in range(n)))
    assert len(tops) == 1, "deterministic mode gave one prompt different logits"
    return drawn, list(next(iter(tops)))


async def device_first_tokens(
    engine: LlamaCppEngine, params: SamplingParams, n: int
) -> tuple[Counter[bytes], list[tuple[bytes, float]]]:
    """As `first_tokens`, drawn by the device chain: the reference top 20 from one host
    request with logprobs, the n draws counted by their text (checked to be one-to-one)."""
    _, top = await first_tokens(engine, SamplingParams(max_tokens=1, logprobs=TOP), 1)
    texts = [tok.decode("utf-8") for tok, _lp in top]  # raises if a token is not whole text
    assert len(set(texts)) == len(texts), "two candidate tokens print the same text"
    prompt = engine.tokenize(PROMPT, add_special=True)
    before = engine.device_rows

    async def one() -> bytes:
        return "".join([d.text async for d in engine.submit(prompt, params)]).encode()

    drawn = Counter(await asyncio.gather(*(one() for _ in range(n))))
    assert engine.device_rows - before == n, "a draw did not go through the device chain"
    return drawn, top


def expected(top: list[tuple[bytes, float]], p: SamplingParams) -> dict[bytes, float]:
    """The parameters' distribution over the top tokens (and b"" for the rest, unfiltered)."""
    logp = np.array([lp for _tok, lp in top], dtype=np.float64)  # sorted, best first
    mass = np.exp(logp)
    n = len(logp)
    if p.top_k > 0:
        n = min(n, p.top_k)
    if p.top_p < 1.0:
        cum = np.cumsum(mass)  # over the whole vocabulary's normaliser: raw logprobs
        assert cum[-1] >= p.top_p, "the nucleus reaches past the reported tokens"
        n = min(n, int(np.searchsorted(cum, p.top_p, side="left")) + 1)
    if p.min_p > 0.0:
        n = min(n, int((logp >= logp[0] + math.log(p.min_p)).sum()))
    filtered = n < len(logp) or p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
    weights = np.exp((logp[:n] - logp[0]) / p.temperature)
    out = {top[i][0]: float(w) for i, w in enumerate(weights)}
    if not filtered:
        assert p.temperature == 1.0, "the tail's mass is only known at temperature 1"
        out[b""] = (1.0 - mass.sum()) / mass[0]
    total = sum(out.values())
    return {tok: w / total for tok, w in out.items()}


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},  # OpenAI's defaults: the whole softmax
        {"temperature": 0.8, "top_p": 0.95},
        {"temperature": 1.5, "top_k": 8, "top_p": 0.97, "min_p": 0.01},
    ],
    ids=["client-defaults", "sampled", "top_k+top_p+min_p"],
)
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
async def test_first_tokens_fit_the_distribution(
    model_path: Path, kw: dict[str, float], path: DeviceSampling
) -> None:
    async with running(model_path, path) as engine:
        if path is DeviceSampling.ON:
            params = SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]
            drawn, top = await device_first_tokens(engine, params, DRAWS)
        else:
            params = SamplingParams(max_tokens=1, logprobs=TOP, **kw)  # type: ignore[arg-type]
            drawn, top = await first_tokens(engine, params, DRAWS)
    want = expected(top, params)
    tail = sum(c for tok, c in drawn.items() if tok not in want)
    if b"" not in want:
        assert tail == 0, f"{tail} draws outside the candidate set"
    keys = list(want)
    counts = np.array([tail if k == b"" else drawn[k] for k in keys], dtype=float)
    probs = np.array([want[k] for k in keys])
    assert chi_square_p(counts, probs * DRAWS) > P_FLOOR, (dict(drawn), want)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
async def test_a_seed_draws_the_same_tokens_alone_or_batched(
    model_path: Path, path: DeviceSampling
) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    others = [
        ("Once upon a time", SamplingParams(max_tokens=20, temperature=1.2, seed=s))
        for s in range(5)
    ]
    async with running(model_path, path) as engine:

        async def text(prompt: str, p: SamplingParams) -> str:
            ids = engine.tokenize(prompt, add_special=True)
            return "".join([d.text async for d in engine.submit(ids, p)])

        alone = await text(PROMPT, params)
        batched = await asyncio.gather(text(PROMPT, params), *(text(*o) for o in others))
        reseeded = {
            await text(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=s))
            for s in (1, 2, 3)
        }
    assert batched[0] == alone
    assert reseeded != {alone}
    assert (engine.device_rows > 0) == (path is DeviceSampling.ON)


async def test_a_host_request_after_a_device_chain_reads_its_own_logits(model_path: Path) -> None:
    """A finished request's device chain stays on its seq_id for the next one (no rebuild);
    a request sampled on the host there (the lowest free seq_id: always 0 here) must get it
    detached, or llama.cpp would not copy that
    row's logits out and the host would read stale ones."""
    host = SamplingParams(max_tokens=1, logprobs=TOP)
    async with running(model_path, DeviceSampling.ON) as engine:
        _, before = await first_tokens(engine, host, 1)
        for kw in ({"temperature": 0.8, "top_p": 0.95}, {"temperature": 0.0}):
            drawn_before = engine.device_rows
            ids = engine.tokenize(PROMPT, add_special=True)
            params = SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]
            assert [d async for d in engine.submit(ids, params)]
            assert engine.device_rows == drawn_before + 1
            _, after = await first_tokens(engine, host, 1)
            assert after == before
