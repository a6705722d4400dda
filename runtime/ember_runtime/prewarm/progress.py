"""Progress of a prewarm: a byte counter shared by the copy threads, and a line per interval.

The line goes to stdout so `kubectl logs -c prewarm` shows where a slow init container is:

    prewarm: 120.0/253.1 MB (47.4%) 61.2 MB/s ETA 2.2s
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(
        self,
        total_bytes: int,
        out: TextIO,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_bytes = total_bytes
        self._out = out
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._done = 0
        self._start = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    @property
    def done_bytes(self) -> int:
        with self._lock:
            return self._done

    def line(self) -> str:
        done = self.done_bytes
        elapsed = max(self._clock() - self._start, 1e-9)
        rate = done / elapsed
        pct = 100.0 * done / self.total_bytes if self.total_bytes else 100.0
        eta = f"{(self.total_bytes - done) / rate:.1f}s" if rate > 0 else "?"
        return (
            f"prewarm: {done / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB ({pct:.1f}%) "
            f"{rate / 1e6:.1f} MB/s ETA {eta}"
        )

    def emit(self) -> None:
        self._out.write(self.line() + "\n")
        self._out.flush()

    def __enter__(self) -> Progress:
        self._start = self._clock()
        self._thread = threading.Thread(target=self._run, name="prewarm-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.emit()  # the final figure, even for copies shorter than one interval

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.emit()
