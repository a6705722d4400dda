"""Delayed work by object key, one small table (`DueTable`) and one task each for all objects:
retries of failed reconciles (`Requeue`) and coalesced status refreshes (`Coalescer`).

Kopf retries only its state-keeping handlers (create/update/resume), and those cost a finalizer
and annotation writes on every object (see `handlers`). Ember reconciles from watch events, which
Kopf does not retry, so a reconcile that hit a transient API error is put here and run again
after its backoff. A newer event for the same object does not wait for it: it reconciles at
once, and its success clears the entry.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

Key = tuple[str, str]
V = TypeVar("V")
MAX_BACKOFF_SECONDS = 300.0
TICK_SECONDS = 0.5  # a constant cost (one dict scan), not per object

log = logging.getLogger(__name__)


def backoff(attempt: int) -> float:
    """5 s, 10 s, 20 s … capped at 5 min."""
    return float(min(MAX_BACKOFF_SECONDS, 5 * 2 ** min(attempt, 6)))


class DueTable(Generic[V]):
    """Key -> (monotonic due time, value), thread-safe; what both tables below are made of."""

    def __init__(self) -> None:
        self._due: dict[Key, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def put(self, key: Key, at: float, value: V, *, keep_earlier: bool = False) -> None:
        with self._lock:
            if keep_earlier and key in self._due:
                return
            self._due[key] = (at, value)

    def clear(self, key: Key) -> None:
        with self._lock:
            self._due.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._due

    def pending(self) -> dict[Key, V]:
        with self._lock:
            return {k: value for k, (_, value) in self._due.items()}

    def take_due(self, now: float | None = None) -> list[tuple[Key, V]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(k, value) for k, (at, value) in self._due.items() if at <= now]
            for k, _ in due:
                del self._due[k]
        return due


class Requeue(DueTable[int]):
    """Failed reconciles by key, with the attempt number their retry will be."""

    def later(self, key: Key, attempt: int) -> float:
        """Schedule attempt number `attempt + 1`; returns the delay."""
        delay = backoff(attempt)
        self.put(key, time.monotonic() + delay, attempt + 1)
        return delay

    def soon(self, key: Key, delay: float) -> None:
        """Reconcile again in `delay` seconds (a rollout's bake or timeout ends then), unless
        something is due sooner."""
        at = time.monotonic() + delay
        with self._lock:
            if key in self._due and self._due[key][0] <= at:
                return
            self._due[key] = (at, 0)

    async def run(self, work: Callable[[Key, int], None]) -> None:
        """Call `work(key, attempt)` in a thread for each entry that falls due."""
        while True:
            for key, attempt in self.take_due():
                try:
                    await asyncio.to_thread(work, key, attempt)
                except Exception:  # work reschedules its own failures; this is a bug guard
                    log.exception("retry of %s/%s failed", *key)
            await asyncio.sleep(TICK_SECONDS)


class Coalescer(DueTable[float]):
    """Status refreshes, coalesced: a mark opens a short window and each later mark of the same
    object extends it (the value kept is the first mark's time), but never past `max_wait`
    after that first mark; one refresh at its end writes what all of them changed. A replica
    coming up is four or five pod and Deployment events a fraction of a second apart (created,
    scheduled, running, ready, the Deployment's counts): a fixed window cut that burst into
    two or three status writes, one per window; a lone change (a thermal report) still goes out
    one window after it happened."""

    def __init__(
        self,
        window: float,
        max_wait: float | None = None,
        workers: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window, self.workers, self.clock = window, workers, clock
        self.max_wait = 3 * window if max_wait is None else max_wait
        self._queued: set[Key] = set()  # due, waiting for a worker (event loop only)

    def mark(self, key: Key) -> None:
        now = self.clock()
        with self._lock:
            first = self._due[key][1] if key in self._due else now
            self._due[key] = (min(now + self.window, first + self.max_wait), first)

    async def run(self, work: Callable[[Key, float], None], tick: float = 0.05) -> None:
        """Call `work(key, first mark's time)` for each window that closes, on `workers`
        threads of its own that each take the next due key as soon as they are free. Each write
        is a round trip to the API server (~0.1 s on a busy one): at fleet scale a rollout
        closes hundreds of windows at once, and thermal churn closes tens a second. Batches
        split over a few threads and awaited together made every batch wait for its slowest
        write, about 40 writes a second in all, below the churn's 50; and the default thread
        pool (6 threads on 2 CPUs) is shared with every other `to_thread` in the operator."""
        queue: asyncio.Queue[tuple[Key, float]] = asyncio.Queue()
        pool = ThreadPoolExecutor(self.workers, "ember-status")
        tasks = [asyncio.create_task(self._serve(queue, pool, work)) for _ in range(self.workers)]
        try:
            while True:
                for key, first in self.take_due():
                    if key not in self._queued:  # else the queued refresh reads the news too
                        self._queued.add(key)
                        queue.put_nowait((key, first))
                await asyncio.sleep(tick)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pool.shutdown(wait=False, cancel_futures=True)

    async def _serve(
        self,
        queue: asyncio.Queue[tuple[Key, float]],
        pool: ThreadPoolExecutor,
        work: Callable[[Key, float], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            key, first = await queue.get()
            self._queued.discard(key)  # a mark from now on needs a refresh of its own
            call = functools.partial(contextvars.copy_context().run, work, key, first)
            try:
                await loop.run_in_executor(pool, call)
            except Exception:  # work handles API errors itself; this is a bug guard
                log.exception("status refresh of %s/%s failed", *key)
