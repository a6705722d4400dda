"""Polling until something holds: the one `wait_for` (threads), `wait_async` (event loop) and
`poll` (for a wait whose timeout is an outcome to report, not a failure)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

OnFail = str | Callable[[], str]


class WaitTimeout(AssertionError, TimeoutError):
    """A wait that ran out: a failure to pytest (AssertionError), a TimeoutError to code that
    goes on past one (a bench's next scenario, a cluster start-up that reports it)."""


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.25,
    *,
    until: Callable[[Any], object] = bool,
    tolerate: tuple[type[BaseException], ...] = (),
    on_fail: OnFail = "",
) -> Any:
    """Poll `check` until `until` holds for what it returned (by default: until it returns
    something truthy), and return that. Exceptions of the `tolerate` types count as "not yet"
    (a server still starting); others propagate, so a `check` that raises ends the wait (a
    process that died). On timeout a WaitTimeout names `what`, the last value seen and
    `on_fail` (a callable is read then, e.g. a log's tail as it is at the end)."""
    held, last = _attempts(check, timeout, interval, until, tolerate)
    if not held:
        raise _timed_out(what, timeout, last, on_fail)
    return last


def poll(
    check: Callable[[], Any],
    timeout: float,
    interval: float = 0.25,
    *,
    until: Callable[[Any], object] = bool,
) -> Any:
    """`wait_for` for a wait whose timeout is not a failure (a grace period, a drill that
    reports what it saw): what `check` returned last, whether `until` held for it or not."""
    return _attempts(check, timeout, interval, until, ())[1]


def _attempts(
    check: Callable[[], Any],
    timeout: float,
    interval: float,
    until: Callable[[Any], object],
    tolerate: tuple[type[BaseException], ...],
) -> tuple[bool, Any]:
    """Whether `until` held before `timeout`, and what `check` returned (or raised) last."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
        except tolerate as exc:
            last = exc
        else:
            if until(last):
                return True, last
        if time.monotonic() >= deadline:
            return False, last
        time.sleep(interval)


async def wait_async(
    what: str,
    check: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.02,
    *,
    until: Callable[[Any], object] = bool,
    on_fail: OnFail = "",
) -> Any:
    """`wait_for` for a test on the event loop: it sleeps without blocking the loop, and
    `check` may be a coroutine function (an HTTP client's get)."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if until(last):
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, on_fail)
        await asyncio.sleep(interval)


def _timed_out(what: str, timeout: float, last: Any, on_fail: OnFail) -> WaitTimeout:
    detail = on_fail() if callable(on_fail) else on_fail
    return WaitTimeout(
        f"timed out after {timeout:g}s waiting for {what}; last: {last!r}"
        + (f"\n{detail}" if detail else "")
    )
