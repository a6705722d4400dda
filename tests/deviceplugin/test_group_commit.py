"""GroupCommit: concurrent Allocate calls share checkpoint writes; a lone caller skips the
thread hop. A real allocator and checkpoint in a temp dir."""

from __future__ import annotations

import asyncio
import threading
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


async def test_a_lone_caller_after_a_lone_batch_is_written_on_the_loop(tmp_path: Path) -> None:
    alloc = Recording(tmp_path / "a.json")
    commits = GroupCommit(alloc)
    for i in range(3):
        await commits.submit([[f"davinci0-ctx{i}"]])
    threads = [t for _, t in alloc.batches]
    loop_thread = threading.get_ident()
    assert threads[0] != loop_thread  # nothing known yet: a worker, as under contention
    assert threads[1:] == [loop_thread, loop_thread]
    assert len(alloc.live_ids()) == 3
