"""The event-loop side of a llama.cpp request (llama-server's result queue): each request's
queue of deltas and its cancel flag, and the hand-over of one step's deltas from the decode
thread in a single `call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ember_runtime.engines.base import Delta


class Stream:
    """What `submit` returns (a `GenerationStream`): the deltas as the decode thread puts them;
    `cancel` sets the flag and wakes the decode thread (`wake`) to drop the request."""

    __slots__ = ("_prompt_tokens", "_queue", "_wake", "cancelled")

    def __init__(self, wake: Callable[[], None], prompt_tokens: int) -> None:
        self._wake = wake
        self._prompt_tokens = prompt_tokens
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._wake()

    def put(self, delta: Delta) -> None:
        """Event loop only (the decode thread goes through `deliver`)."""
        self._queue.put_nowait(delta)


def deliver(emits: list[tuple[Stream, Delta]]) -> None:
    """Put each delta in its stream: one step's output, run on the event loop."""
    for stream, delta in emits:
        stream.put(delta)
