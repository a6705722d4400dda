"""A token bucket for origin (WAN) traffic: bandwidth manners on thin, metered site links.

The download loop calls `take(n)` after each chunk it read; the bucket sleeps the thread
until the average rate is back under `rate` bytes/s. TCP's window does the rest: a reader
that pauses makes the sender pause, so the link sees the limit, not bursts of line rate.
`burst` bounds how far ahead of the rate a transfer may run after a pause (default: one
second's worth, at least one read chunk). One bucket per agent, shared by all of its origin
downloads (thread-safe), so the limit holds for the node whatever the number of files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else max(rate, float(1 << 20))
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()
        self._sleep = sleep

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def reserve(self, n: int) -> float:
        """Take `n` tokens (the balance may go negative); seconds to wait before going on."""
        with self._lock:
            self._refill()
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def take(self, n: int, stop: threading.Event | None = None) -> None:
        """Block until `n` bytes fit the rate; InterruptedError when `stop` is set meanwhile."""
        wait = self.reserve(n)
        if wait <= 0:
            return
        if self._sleep is not None:
            self._sleep(wait)
        elif stop is not None:
            if stop.wait(wait):
                raise InterruptedError("stopped while rate-limited")
        else:
            time.sleep(wait)
