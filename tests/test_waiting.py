"""The one polling helper (tests/support/waiting.py) that tests and benches wait with."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from tests.support.waiting import WaitTimeout, poll, wait_async, wait_for


def test_wait_for_returns_the_first_value_that_holds() -> None:
    counter = itertools.count()
    assert wait_for("3", lambda: next(counter), 5, 0, until=lambda n: n >= 3) == 3
    assert wait_for("truthy", iter([0, "", "x"]).__next__, 5, 0) == "x"


def test_a_timeout_names_what_the_last_value_and_the_log_as_it_is_then() -> None:
    seen: list[int] = []
    counter = itertools.count()

    def check() -> int:
        seen.append(next(counter))
        return seen[-1]

    with pytest.raises(WaitTimeout) as timed_out:
        wait_for("never", check, 0.05, 0.01, until=lambda n: n < 0, on_fail=lambda: f"{seen}")
    message = str(timed_out.value)
    assert message.startswith(f"timed out after 0.05s waiting for never; last: {seen[-1]}\n")
    assert message.endswith(f"{seen}")  # read at the end, not when the wait began
    # A test failure to pytest, a TimeoutError to a bench that goes on past one.
    assert isinstance(timed_out.value, AssertionError)
    assert isinstance(timed_out.value, TimeoutError)


def test_tolerated_exceptions_are_not_yet_others_end_the_wait() -> None:
    answers: Iterator[str | Exception] = iter(
        [ConnectionError("starting"), ConnectionError("starting"), "up"]
    )

    def check() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for("up", check, 5, 0, tolerate=(ConnectionError,)) == "up"

    def died() -> bool:
        raise ValueError("the process died")

    with pytest.raises(ValueError, match="died"):
        wait_for("up", died, 5, 0, tolerate=(ConnectionError,))


def test_poll_gives_the_last_value_at_its_timeout() -> None:
    counter = itertools.count()
    last = poll(lambda: next(counter), 0.05, 0.01, until=lambda n: n < 0)
    assert last > 0
    assert poll(lambda: "done", 5) == "done"


def test_wait_async_awaits_a_coroutine_check() -> None:
    counter = itertools.count()

    async def check() -> int:
        await asyncio.sleep(0)
        return next(counter)

    async def main() -> None:
        assert await wait_async("2", check, 5, 0, until=lambda n: n == 2) == 2
        with pytest.raises(WaitTimeout, match="waiting for never; last: "):
            await wait_async("never", check, 0.05, 0.01, until=lambda n: n < 0)

    asyncio.run(main())
