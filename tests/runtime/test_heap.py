"""freeze_startup_heap: what exists at start-up leaves the collector's full passes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from ember_runtime.heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # give the rest of the suite its ordinary collector back


def test_startup_objects_are_frozen_and_full_passes_skip_them(unfrozen: None) -> None:
    startup = [{"n": i, "parts": [i, str(i)]} for i in range(200_000)]  # long-lived state
    tracked = len(gc.get_objects())

    frozen = freeze_startup_heap()

    assert frozen >= len(startup)
    assert len(gc.get_objects()) < tracked - len(startup)  # no longer walked
    serving = [[i] for i in range(1000)]  # made after start-up: still collected as usual
    assert gc.is_tracked(serving[0])
    assert any(o is serving for o in gc.get_objects())
