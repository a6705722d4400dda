"""Delayed work by object key, one small table and one task each for all objects: retries of
failed reconciles (`Requeue`) and coalesced status refreshes (`Coalescer`).

Kopf retries only its state-keeping handlers (create/update/resume), and those cost a finalizer
and annotation writes on every object (see `handlers`). Ember reconciles from watch events, which
Kopf does not retry, so a reconcile that hit a transient API error is put here and run again
after its backoff. A newer event for the same object does not wait for it: it reconciles at
once, and its success clears the entry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

Key = tuple[str, str]
MAX_BACKOFF_SECONDS = 300.0
TICK_SECONDS = 0.5  # a constant cost (one dict scan), not per object

log = logging.getLogger(__name__)


def backoff(attempt: int) -> float:
    """5 s, 10 s, 20 s … capped at 5 min."""
    return float(min(MAX_BACKOFF_SECONDS, 5 * 2 ** min(attempt, 6)))


class Requeue:
    def __init__(self) -> None:
        self._due: dict[Key, tuple[float, int]] = {}  # key -> (monotonic due time, attempt)
        self._lock = threading.Lock()

    def later(self, key: Key, attempt: int) -> float:
        """Schedule attempt number `attempt + 1`; returns the delay."""
        delay = backoff(attempt)
        with self._lock:
            self._due[key] = (time.monotonic() + delay, attempt + 1)
        return delay

    def clear(self, key: Key) -> None:
        with self._lock:
            self._due.pop(key, None)

    def pending(self) -> dict[Key, int]:
        with self._lock:
            return {k: attempt for k, (_, attempt) in self._due.items()}

    def take_due(self, now: float | None = None) -> list[tuple[Key, int]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(k, attempt) for k, (at, attempt) in self._due.items() if at <= now]
            for k, _ in due:
                del self._due[k]
        return due

    async def run(self, work: Callable[[Key, int], None]) -> None:
        """Call `work(key, attempt)` in a thread for each entry that falls due."""
        while True:
            for key, attempt in self.take_due():
                try:
                    await asyncio.to_thread(work, key, attempt)
                except Exception:  # work reschedules its own failures; this is a bug guard
                    log.exception("retry of %s/%s failed", *key)
            await asyncio.sleep(TICK_SECONDS)


class Coalescer:
    """Status refreshes, coalesced: the first mark of an object opens a short window, marks within
    it join it, and one refresh at its end writes what all of them changed. A replica coming up
    is four or five pod and Deployment events within a second or two (created, scheduled,
    running, ready); without this each could be its own status write."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._due: dict[Key, float] = {}
        self._lock = threading.Lock()

    def mark(self, key: Key) -> None:
        with self._lock:
            self._due.setdefault(key, time.monotonic() + self.window)

    def take_due(self, now: float | None = None) -> list[Key]:
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [k for k, at in self._due.items() if at <= now]
            for k in due:
                del self._due[k]
        return due

    async def run(self, work: Callable[[list[Key]], None], tick: float = 0.1) -> None:
        """Call `work(keys)` in a thread with the keys whose window has closed."""
        while True:
            due = self.take_due()
            if due:
                try:
                    await asyncio.to_thread(work, due)
                except Exception:
                    log.exception("status refresh of %d objects failed", len(due))
            await asyncio.sleep(tick)
