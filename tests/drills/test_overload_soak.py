"""Drill 3: the runtime server (real llama.cpp engine, packaged Gemma) under 4x its queue bound of
streaming clients that hang up mid-stream at random (tests/drills/soak.py).

Every answer is a stream or a quick 429 with Retry-After; the server never crashes; its RSS at
the end is within 10% of its RSS after warm-up; and once the crowd leaves, every admitted
request is accounted for as finished or cancelled, with no sequence left queued or running.
Short: 40 s in the suite; `make drills` runs 10 minutes and writes bench/results/drills.*.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.drills import soak
from tests.drills.common import record, scale, table
from tests.support.model import default_model_path
from tests.support.waiting import poll

MAX_BATCH = 2
MAX_QUEUE = 4  # the admission queue's bound; beyond it the server answers 429
CLIENTS = 4 * MAX_QUEUE
HANG_UP = 0.3  # the share of admitted streams the client abandons after 1-8 chunks
RSS_GROWTH_BOUND = 0.10
REJECT_BOUND_S = 2.0  # a 429 must come back at once, not after waiting in line
SEED = 3


@dataclass(frozen=True)
class Size:
    seconds: float
    warmup: float  # RSS is compared from here (the engine's buffers and caches are grown)


SIZES = {
    "short": Size(seconds=40, warmup=10),
    "medium": Size(seconds=180, warmup=30),
    "full": Size(seconds=600, warmup=60),
}


async def _soak(server: soak.Server, size: Size) -> tuple[soak.Tally, list[tuple[float, int]]]:
    """The crowd, with the server's RSS sampled every second meanwhile."""
    samples: list[tuple[float, int]] = []
    start = time.monotonic()

    async def sample() -> None:
        while server.alive():
            samples.append((time.monotonic() - start, server.rss_bytes()))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    tally = await soak.crowd(server.url, CLIENTS, size.seconds, HANG_UP, SEED)
    sampler.cancel()
    return tally, samples


def _settled(server: soak.Server, timeout: float = 20.0) -> dict[str, float]:
    """The server's metrics once nothing is queued or running (or at the timeout)."""

    def idle(metrics: dict[str, float]) -> bool:
        busy = ("ember_queue_depth", "ember_active_sequences")
        return sum(soak.series_sum(metrics, name) for name in busy) == 0

    settled: dict[str, float] = poll(server.metrics, timeout, 0.2, until=idle)
    return settled


@dataclass(frozen=True)
class Outcome:
    """What the server showed: alive at the end, its exit code, log, settled metrics, RSS."""

    alive: bool
    code: int
    log: str
    metrics: dict[str, float]
    samples: list[tuple[float, int]]
    warmup: float

    def finished(self, reason: str = "") -> float:
        return soak.series_sum(self.metrics, "ember_generations_finished_total", reason)

    def left(self) -> float:
        m = self.metrics
        return soak.series_sum(m, "ember_queue_depth") + soak.series_sum(
            m, "ember_active_sequences"
        )

    def rss(self) -> tuple[int, int]:
        """RSS after warm-up and at the end ((0, 0) when the server died before a sample)."""
        if not self.samples:
            return 0, 0
        warm = next((rss for t, rss in self.samples if t >= self.warmup), self.samples[0][1])
        return warm, self.samples[-1][1]

    def growth(self) -> float:
        warm, end = self.rss()
        return end / warm - 1 if warm else 0.0


def run(size: Size, workdir: Path) -> tuple[soak.Tally, Outcome]:
    server = soak.Server(default_model_path(), workdir, MAX_BATCH, MAX_QUEUE)
    server.start()
    try:
        tally, samples = asyncio.run(_soak(server, size))
        alive = server.alive()
        metrics = _settled(server) if alive else {}
    finally:
        code = server.stop()
    log = server.log.read_text(errors="replace")
    return tally, Outcome(alive, code, log, metrics, samples, size.warmup)


def rows_of(size: Size, tally: soak.Tally, out: Outcome) -> list[tuple[str, Any]]:
    rejects = tally.reject_seconds
    p99, worst = soak.percentile(rejects, 0.99) * 1e3, max(rejects, default=0) * 1e3
    warm, end = out.rss()
    setup = f"{size.seconds:.0f} / {CLIENTS} / {MAX_QUEUE} / {MAX_BATCH}"
    failures = f"{dict(tally.other_status)} / {dict(tally.transport_errors)}"
    crash = f"{not out.alive} / {out.log.count('Traceback')} / {out.code}"
    return [
        ("duration (s) / clients / queue bound / batch", setup),
        ("admitted (200)", tally.admitted),
        ("… streamed to [DONE]", tally.completed),
        ("… hung up mid-stream by the client", tally.hung_up),
        ("… cut off by the server", tally.cut_off),
        ("error events inside streams", tally.stream_errors),
        ("rejected (429)", tally.rejected),
        ("… without a Retry-After", tally.without_retry_after),
        ("… latency p99 / max (ms)", f"{p99:.0f} / {worst:.0f}"),
        ("other statuses / transport errors", failures),
        ("server finished generations (metrics)", f"{out.finished():.0f}"),
        ("… cancelled / error", f"{out.finished('cancelled'):.0f} / {out.finished('error'):.0f}"),
        ("sequences queued or running afterwards", f"{out.left():.0f}"),
        ("RSS after warm-up / at the end (MB)", f"{warm / 1e6:.0f} / {end / 1e6:.0f}"),
        ("RSS growth", f"{out.growth():+.1%}"),
        ("server crashed / tracebacks / exit code", crash),
    ]


def test_runtime_overload_soak(tmp_path: Path) -> None:
    size = SIZES[scale()]
    tally, out = run(size, tmp_path)
    rows = rows_of(size, tally, out)
    print(f"\nruntime overload soak ({scale()}, seed {SEED})\n{table(rows)}")
    if scale() == "full":
        result = {"admitted": tally.admitted, "rejected": tally.rejected, "growth": out.growth()}
        record("runtime overload soak", result, rows)
    assert out.alive and out.code == 0 and "Traceback" not in out.log, out.log[-4000:]
    assert tally.rejected > 0 and tally.admitted > 0  # it really was over its bound, and served
    assert tally.without_retry_after == 0
    assert max(tally.reject_seconds) <= REJECT_BOUND_S
    assert not tally.other_status and not tally.transport_errors
    assert tally.cut_off == 0 and tally.stream_errors == 0
    # Every request the server admitted ended as finished or cancelled, none as an error, and
    # nothing is still queued or holding a slot.
    assert out.finished() == tally.admitted
    assert out.finished("error") == 0
    assert out.left() == 0
    assert out.growth() <= RSS_GROWTH_BOUND, out.samples
