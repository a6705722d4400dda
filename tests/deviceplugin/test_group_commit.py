"""GroupCommit: concurrent Allocate calls share checkpoint writes, a contended write waits its
window for more callers, a lone caller skips the window and the thread hop. A real allocator
and checkpoint in a temp dir."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ember_runtime.deviceplugin.allocator import (
    Allocation,
    AllocationError,
    Checkpoint,
    ContextAllocator,
)
from ember_runtime.deviceplugin.server import GroupCommit


class Recording(ContextAllocator):
    """Notes each batch's size and the thread that wrote it."""

    def __init__(self, path: Path) -> None:
        super().__init__(Checkpoint(path), id_space=1000, node_ordinal=None)
        self.batches: list[tuple[int, int]] = []

    def allocate_batch(
        self, batch: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[Allocation] | AllocationError]:
        self.batches.append((len(batch), threading.get_ident()))
        return super().allocate_batch(batch)


async def test_concurrent_calls_share_writes_and_get_distinct_ids(tmp_path: Path) -> None:
    alloc = Recording(tmp_path / "a.json")
    commits = GroupCommit(alloc)
    units = [[[f"davinci{i % 8}-ctx{i // 8}"]] for i in range(32)]
    results = await asyncio.gather(*(commits.submit(u) for u in units))
    ids = [a.contexts[f"davinci{i % 8}"] for i, (a,) in enumerate(results)]
    assert len(set(ids)) == 32
    assert sum(size for size, _ in alloc.batches) == 32
    assert len(alloc.batches) < 32  # queued behind the first write, then written together
    loop_thread = threading.get_ident()
    assert all(t != loop_thread for size, t in alloc.batches if size > 1)  # in a worker
    assert ContextAllocator(Checkpoint(tmp_path / "a.json"), 1000, None).live_ids() == set(ids)


async def test_a_lone_caller_is_written_on_the_loop_without_waiting(tmp_path: Path) -> None:
    alloc = Recording(tmp_path / "a.json")
    commits = GroupCommit(alloc, window=0.5)
    started = time.monotonic()
    for i in range(3):
        await commits.submit([[f"davinci0-ctx{i}"]])
    assert time.monotonic() - started < 0.25  # the window is for contended writes only
    loop_thread = threading.get_ident()
    assert [t for _, t in alloc.batches] == [loop_thread] * 3
    assert len(alloc.live_ids()) == 3


async def test_after_a_shared_write_the_next_waits_for_callers_on_their_way(
    tmp_path: Path,
) -> None:
    alloc = Recording(tmp_path / "a.json")
    commits = GroupCommit(alloc, window=0.2)
    await asyncio.gather(*(commits.submit([[f"davinci0-ctx{i}"]]) for i in range(2)))

    async def late(i: int) -> list[Allocation]:
        await asyncio.sleep(0.05)  # arrives while the first caller's write waits its window
        return await commits.submit([[f"davinci1-ctx{i}"]])

    first, second = await asyncio.gather(commits.submit([["davinci1-ctx9"]]), late(0))
    assert [size for size, _ in alloc.batches] == [2, 2]  # without the window: [2, 1, 1]
    assert first[0].contexts["davinci1"] != second[0].contexts["davinci1"]


async def test_the_wait_ends_once_as_many_callers_as_last_time_are_pending(
    tmp_path: Path,
) -> None:
    alloc = Recording(tmp_path / "a.json")
    commits = GroupCommit(alloc, window=1.0)
    await asyncio.gather(*(commits.submit([[f"davinci0-ctx{i}"]]) for i in range(4)))

    async def soon(i: int) -> list[Allocation]:
        await asyncio.sleep(0.02 * i)  # callers in lock-step come back one after another
        return await commits.submit([[f"davinci1-ctx{i}"]])

    started = time.monotonic()
    await asyncio.gather(*(soon(i) for i in range(4)))
    assert time.monotonic() - started < 0.5  # the fourth arrival closed it, not the window
    assert [size for size, _ in alloc.batches] == [4, 4]
