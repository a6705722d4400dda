"""Retries of failed reconciles, with backoff: one small table and one task for all objects.

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
