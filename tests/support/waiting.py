"""Polling until something holds: the one `wait_for` (threads) and `wait_async` (event loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.25,
    *,
    tolerate: tuple[type[BaseException], ...] = (),
    on_fail: str = "",
) -> Any:
    """Poll `check` until it returns something truthy, and return that. Exceptions of the
    `tolerate` types count as "not yet" (a server still starting); others propagate. On timeout
    an AssertionError names `what`, the last value seen and `on_fail` (e.g. a log's tail)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
        except tolerate as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            detail = f"\n{on_fail}" if on_fail else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what}; last: {last!r}{detail}"
            )
        time.sleep(interval)


async def wait_async(
    what: str, check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02
) -> Any:
    """`wait_for` for a test on the event loop: it sleeps without blocking the loop."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        await asyncio.sleep(interval)
