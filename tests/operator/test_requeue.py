"""The delayed-work tables: retries (backoff, one entry per object, cleared by a success) and
coalesced status refreshes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from ember_operator.requeue import MAX_BACKOFF_SECONDS, Coalescer, Requeue, backoff

from tests.support.waiting import wait_async


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff(a) for a in range(4)] == [5.0, 10.0, 20.0, 40.0]
    assert backoff(50) == MAX_BACKOFF_SECONDS


def test_due_entries_come_out_once_with_their_attempt() -> None:
    queue = Requeue()
    delay = queue.later(("ns", "a"), attempt=2)
    queue.later(("ns", "b"), attempt=0)
    assert delay == 20.0
    assert queue.take_due() == []  # nothing is due yet
    later = time.monotonic() + 30
    assert sorted(queue.take_due(now=later)) == [(("ns", "a"), 3), (("ns", "b"), 1)]
    assert queue.take_due(now=later) == [] and queue.pending() == {}


def test_a_newer_failure_replaces_the_entry_and_success_clears_it() -> None:
    queue = Requeue()
    queue.later(("ns", "a"), attempt=0)
    queue.later(("ns", "a"), attempt=1)
    assert queue.pending() == {("ns", "a"): 2}
    queue.clear(("ns", "a"))
    assert queue.pending() == {}


def test_run_calls_the_work_for_due_entries() -> None:
    queue = Requeue()
    done: list[tuple[tuple[str, str], int]] = []

    async def main() -> None:
        queue.later(("ns", "a"), attempt=0)
        queue.put(("ns", "a"), 0.0, 1)  # due now, without waiting 5 s
        task = asyncio.create_task(queue.run(lambda key, attempt: done.append((key, attempt))))
        await wait_async("the due entry's work", lambda: done, 2, 0.05)
        task.cancel()

    asyncio.run(main())
    assert done == [(("ns", "a"), 1)]


def test_each_mark_extends_the_window_up_to_its_bound() -> None:
    now = [100.0]
    refreshes = Coalescer(window=10.0, max_wait=30.0, clock=lambda: now[0])
    refreshes.mark(("ns", "a"))
    assert refreshes.take_due(now=109.9) == []
    now[0] = 105.0
    refreshes.mark(("ns", "a"))  # a burst: the window now ends 10 s after this mark
    assert refreshes.take_due(now=110.0) == []
    assert refreshes.pending() == {("ns", "a"): 100.0}  # the burst's start is kept
    for t in (115.0, 125.0):  # marks keep coming: the write goes out max_wait after the first
        now[0] = t
        refreshes.mark(("ns", "a"))
    assert refreshes.take_due(now=129.99) == []
    assert refreshes.take_due(now=130.0) == [(("ns", "a"), 100.0)]


def test_a_lone_mark_is_due_one_window_later() -> None:
    refreshes = Coalescer(window=0.5, clock=lambda: 7.0)
    refreshes.mark(("ns", "a"))
    assert refreshes.take_due(now=7.49) == []
    assert refreshes.take_due(now=7.5) == [(("ns", "a"), 7.0)]


def test_a_slow_status_write_does_not_hold_back_the_others() -> None:
    """At fleet scale a rollout closes hundreds of windows at once and thermal churn tens a
    second: the workers write concurrently, and one write stuck on a slow API server leaves
    the rest flowing (batches awaited together waited for their slowest write)."""
    refreshes = Coalescer(window=0.0, workers=4)
    keys = [("ns", f"o{i}") for i in range(20)]
    release = threading.Event()
    written: list[tuple[str, str]] = []

    def work(key: tuple[str, str], first: float) -> None:
        if key == ("ns", "o0"):
            assert release.wait(timeout=5)
        written.append(key)

    async def main() -> list[tuple[str, str]]:
        for key in keys:
            refreshes.mark(key)
        task = asyncio.create_task(refreshes.run(work, tick=0.01))
        await wait_async("all but the stuck key", lambda: len(written) == len(keys) - 1, 2, 0.01)
        before_release = list(written)
        release.set()
        await wait_async("every key", lambda: len(written) == len(keys), 2, 0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return before_release

    before_release = asyncio.run(main())
    assert sorted(before_release) == sorted(keys[1:])  # all but the stuck one, meanwhile
    assert sorted(written) == sorted(keys)


def test_a_key_marked_again_while_queued_is_refreshed_once() -> None:
    """With every worker busy, due keys wait in the queue; a new mark of a queued key is
    news its queued refresh will read anyway, so it is not queued twice."""
    refreshes = Coalescer(window=0.0, workers=1)
    gate = threading.Event()
    calls: list[tuple[str, str]] = []

    def work(key: tuple[str, str], first: float) -> None:
        if key == ("ns", "busy"):
            assert gate.wait(timeout=5)
        calls.append(key)

    async def main() -> None:
        refreshes.mark(("ns", "busy"))
        task = asyncio.create_task(refreshes.run(work, tick=0.01))
        await asyncio.sleep(0.05)  # the one worker is stuck on "busy"
        for _ in range(5):
            refreshes.mark(("ns", "a"))
            await asyncio.sleep(0.03)  # each mark falls due and is taken while "a" is queued
        gate.set()
        await wait_async("both refreshes", lambda: len(calls) == 2, 1, 0.01)
        await asyncio.sleep(0.1)  # time for a third, which must not come
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert calls == [("ns", "busy"), ("ns", "a")]
