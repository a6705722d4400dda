"""Allocator and preferred-allocation logic, without gRPC."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
from ember_runtime.deviceplugin.allocator import (
    Allocation,
    AllocationError,
    Checkpoint,
    CheckpointError,
    ContextAllocator,
    ExhaustedError,
    preferred_units,
)


def test_checkpoint_round_trip_and_cursor(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "a.json")
    alloc = ContextAllocator(cp, id_space=10, node_ordinal=None)
    first = alloc.allocate([["davinci0-ctx0"], ["davinci0-ctx1", "davinci1-ctx0"]])
    assert [a.contexts for a in first] == [{"davinci0": 0}, {"davinci0": 1, "davinci1": 2}]
    alloc.reconcile({}, grace=0)  # all gone
    again = ContextAllocator(cp, id_space=10, node_ordinal=None)
    # The cursor survives: released IDs come back last, not first.
    assert again.allocate([["davinci0-ctx0"]])[0].contexts == {"davinci0": 3}
    assert not list(tmp_path.glob(".a.json.*"))  # no temp files left behind


def test_threads_never_share_an_id(tmp_path: Path) -> None:
    alloc = ContextAllocator(Checkpoint(tmp_path / "a.json"), id_space=1000, node_ordinal=None)
    got: list[int] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(20):
            (a,) = alloc.allocate([[f"davinci{n}-ctx{i}"]])
            with lock:
                got.extend(a.contexts.values())

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 160 and len(set(got)) == 160


def test_failed_checkpoint_write_issues_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    alloc = ContextAllocator(Checkpoint(state / "a.json"), id_space=4, node_ordinal=None)
    state.write_text("")  # the checkpoint's directory is now a file: every save fails
    with pytest.raises(OSError):
        alloc.allocate([["davinci0-ctx0"]])
    assert alloc.live_ids() == set()


def test_exhaustion_and_bad_checkpoint(tmp_path: Path) -> None:
    alloc = ContextAllocator(Checkpoint(tmp_path / "a.json"), id_space=1, node_ordinal=None)
    alloc.allocate([["davinci0-ctx0"]])
    with pytest.raises(ExhaustedError):
        alloc.allocate([["davinci0-ctx1"]])
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        ContextAllocator(Checkpoint(tmp_path / "b.json"), id_space=1, node_ordinal=None)


def test_reconcile_binds_and_releases_by_owner(tmp_path: Path) -> None:
    alloc = ContextAllocator(Checkpoint(tmp_path / "a.json"), id_space=10, node_ordinal=None)
    alloc.allocate([["davinci0-ctx0"], ["davinci0-ctx1"]])
    owners = {"ns/a/c": frozenset({"davinci0-ctx0"}), "ns/b/c": frozenset({"davinci0-ctx1"})}
    assert alloc.reconcile(owners, grace=0) == []
    assert {a.owner for a in alloc.live()} == {"ns/a/c", "ns/b/c"}
    # Pod a is gone and its unit was handed to pod x: a's ID is released, not inherited.
    owners = {"ns/x/c": frozenset({"davinci0-ctx0"}), "ns/b/c": frozenset({"davinci0-ctx1"})}
    released = alloc.reconcile(owners, grace=1000)
    assert [r.owner for r in released] == ["ns/a/c"]
    assert alloc.live_ids() == {1}


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        (["davinci0-ctx0", "davinci1-ctx0", "davinci1-ctx1"], [], 1, ["davinci1-ctx0"]),
        (
            ["davinci0-ctx0", "davinci0-ctx1", "davinci1-ctx0", "davinci2-ctx0", "davinci2-ctx1"],
            [],
            4,
            ["davinci0-ctx0", "davinci0-ctx1", "davinci2-ctx0", "davinci2-ctx1"],
        ),
        (
            ["davinci0-ctx0", "davinci1-ctx0", "davinci1-ctx1", "davinci1-ctx2", "davinci1-ctx3"],
            ["davinci0-ctx0"],
            2,
            ["davinci0-ctx0", "davinci1-ctx0"],
        ),
    ],
)
def test_preferred_units(
    available: list[str], must: list[str], size: int, expected: list[str]
) -> None:
    assert preferred_units(available, must, size) == expected


@pytest.mark.parametrize(
    ("available", "must", "size"),
    [(["davinci0-ctx0"], [], 2), (["davinci0-ctx0"], ["davinci1-ctx0"], 1), (["x"], [], 1)],
)
def test_preferred_units_rejects(available: list[str], must: list[str], size: int) -> None:
    with pytest.raises(AllocationError):
        preferred_units(available, must, size)


def test_superseded_unseen_allocation_released_by_the_allocate_itself(tmp_path: Path) -> None:
    heard: list[Allocation] = []
    checkpoint = Checkpoint(tmp_path / "a.json")
    alloc = ContextAllocator(checkpoint, id_space=10, node_ordinal=None, on_release=heard.extend)
    alloc.allocate([["davinci0-ctx0"]])  # pod deleted before PodResources ever showed it
    alloc.allocate([["davinci0-ctx1"]])
    alloc.allocate([["davinci0-ctx0"]])  # the kubelet reassigned the unit: the first is gone
    assert [r.contexts for r in heard] == [{"davinci0": 0}]
    assert alloc.live_ids() == {1, 2}
    # ...in the same checkpoint write: a restarted plugin does not resurrect it
    assert [a.contexts for a in checkpoint.load().allocations] == [{"davinci0": 1}, {"davinci0": 2}]
    assert alloc.reconcile({}, grace=1000) == []


def test_incremental_supersede_matches_the_rule_over_every_allocation(tmp_path: Path) -> None:
    """The unit index an Allocate batch consults gives what `_without_superseded` gives over
    the whole list, for random multi-unit batches with reconciles and restarts in between."""
    import random

    from ember_runtime.deviceplugin.allocator import _without_superseded

    rng = random.Random(7)
    units = [f"davinci{d}-ctx{c}" for d in range(3) for c in range(3)]
    checkpoint = Checkpoint(tmp_path / "a.json")
    alloc = ContextAllocator(checkpoint, id_space=500, node_ordinal=None)
    for step in range(300):
        before = alloc.live()
        batch = [[rng.sample(units, rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
        results = alloc.allocate_batch(batch)
        issued = [a for r in results if not isinstance(r, AllocationError) for a in r]
        expected, _ = _without_superseded([*before, *issued])
        assert alloc.live() == expected
        assert alloc.live_ids() == {c for a in expected for c in a.contexts.values()}
        if step % 50 == 49:  # a restart: the index is rebuilt from the checkpoint
            alloc = ContextAllocator(checkpoint, id_space=500, node_ordinal=None)
            assert alloc.live() == expected
        if step % 70 == 69:
            alloc.reconcile({}, grace=1000)  # nothing released, nothing bound: index intact


def test_checkpoint_stays_a_node_long_under_churn(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "a.json")
    alloc = ContextAllocator(checkpoint, id_space=1000, node_ordinal=None)
    units = [f"davinci{d}-ctx{c}" for d in range(4) for c in range(2)]
    for i in range(200):  # no reconcile in between: pods come and go faster than it runs
        alloc.allocate([[units[i % len(units)]]])
    assert len(checkpoint.load().allocations) == len(units)


def test_stale_snapshot_never_binds_to_the_previous_holder(tmp_path: Path) -> None:
    alloc = ContextAllocator(Checkpoint(tmp_path / "a.json"), id_space=10, node_ordinal=None)
    alloc.allocate([["davinci0-ctx0"]])
    alloc.reconcile({"ns/old/c": frozenset({"davinci0-ctx0"})}, grace=1000)
    listed_at = time.time()  # a List sent now, answered after the kubelet moved the unit...
    alloc.allocate([["davinci0-ctx0"]])  # ...to a new pod, whose Allocate lands in between
    alloc.reconcile({"ns/old/c": frozenset({"davinci0-ctx0"})}, grace=1000, listed_at=listed_at)
    (live,) = alloc.live()
    assert live.contexts == {"davinci0": 1} and live.owner is None  # not bound to ns/old/c
    alloc.reconcile({"ns/new/c": frozenset({"davinci0-ctx0"})}, grace=1000)
    assert [a.owner for a in alloc.live()] == ["ns/new/c"]


def _alloc_on(path: Path, ids: int = 100) -> ContextAllocator:
    return ContextAllocator(Checkpoint(path), id_space=ids, node_ordinal=None)


def _count_layouts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    layouts: list[int] = []
    lay_out = Checkpoint._lay_out

    def counted(self: Checkpoint, record: bytes) -> None:
        layouts.append(len(record))
        lay_out(self, record)

    monkeypatch.setattr(Checkpoint, "_lay_out", counted)
    return layouts


def test_checkpoint_log_overwrites_laid_out_space_and_lays_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Checkpoint, "MIN_SPACE", 4096)
    monkeypatch.setattr(Checkpoint, "RECORDS_PER_LAYOUT", 8)
    layouts = _count_layouts(monkeypatch)
    path = tmp_path / "a.json"
    alloc = _alloc_on(path)
    alloc.allocate([["davinci0-ctx0"]])
    size = path.stat().st_size
    for i in range(1, 4):  # records go into the laid-out zeros: no new layout, same size
        alloc.allocate([[f"davinci0-ctx{i}"]])
        assert (len(layouts), path.stat().st_size) == (1, size)
    assert _alloc_on(path).live_ids() == {0, 1, 2, 3}
    switches = _count_switches(monkeypatch)
    for i in range(200):  # far more records than one layout holds
        alloc.allocate([[f"davinci1-ctx{i % 3}"]])
    assert len(layouts) + len(switches) > 5  # the spare, or the old way when it was not ready
    assert _alloc_on(path).live_ids() == alloc.live_ids()
    alloc.close()
    assert not list(tmp_path.glob(".a.json.*"))


def _count_switches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    switches: list[int] = []
    switch = Checkpoint._switch_to_spare

    def counted(self: Checkpoint, record: bytes) -> bool:
        done = switch(self, record)
        if done:
            switches.append(len(record))
        return done

    monkeypatch.setattr(Checkpoint, "_switch_to_spare", counted)
    return switches


def test_a_full_log_continues_in_the_spare_laid_out_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-way through a log a thread lays out the next one; running out of space then costs
    a record, a rename and a directory fsync. The state survives every step."""
    monkeypatch.setattr(Checkpoint, "MIN_SPACE", 4096)
    monkeypatch.setattr(Checkpoint, "RECORDS_PER_LAYOUT", 8)
    layouts, switches = _count_layouts(monkeypatch), _count_switches(monkeypatch)
    path = tmp_path / "a.json"
    checkpoint = Checkpoint(path)
    alloc = ContextAllocator(checkpoint, id_space=100, node_ordinal=None)
    spare = path.with_name(".a.json.next")
    inode = None
    for i in range(60):
        alloc.allocate([[f"davinci{i % 4}-ctx{i % 2}"]])
        assert _alloc_on(path).live_ids() == alloc.live_ids()
        if checkpoint._spare is not None:
            checkpoint._spare.join()  # a quick disk here: ready before the log is full
            assert spare.stat().st_size == checkpoint._spare_space
        if inode is None:
            inode = path.stat().st_ino
    assert len(layouts) == 1  # only the first: every later log was the spare
    assert len(switches) >= 3
    assert path.stat().st_ino != inode  # renamed over the full one
    alloc.close()
    assert not spare.exists()


def test_torn_last_record_is_dropped_and_the_log_laid_out_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layouts = _count_layouts(monkeypatch)
    path = tmp_path / "a.json"
    alloc = _alloc_on(path)
    alloc.allocate([["davinci0-ctx0"]])
    alloc.allocate([["davinci0-ctx1"]])  # the write a crash tears
    raw = path.read_bytes()
    second = raw.index(b"\nv2 ") + 1
    path.write_bytes(raw[: second + 40] + bytes(len(raw) - second - 40))  # a prefix, then zeros
    again = _alloc_on(path)
    assert again.live_ids() == {0}  # the torn Allocate was never answered
    layouts.clear()
    again.allocate([["davinci1-ctx0"]])
    assert len(layouts) == 1  # laid out anew, never written behind torn bytes
    assert _alloc_on(path).live_ids() == {0, 1}


def test_bad_record_with_more_after_it_refuses_to_load(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    alloc = _alloc_on(path)
    alloc.allocate([["davinci0-ctx0"]])
    alloc.allocate([["davinci0-ctx1"]])
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01  # a flipped bit in the first record's checksum
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="more after it"):
        _alloc_on(path)


def test_version_1_checkpoint_is_read_and_rewritten_as_a_log(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    body = (
        b'{"cursor":5,"allocations":[{"contexts":{"davinci0":4},"units":["davinci0-ctx0"],'
        b'"created_at":1.0,"owner":"ns/p/c"}]}'
    )
    header = json.dumps({"version": 1, "checksum": hashlib.sha256(body).hexdigest()})
    path.write_bytes(header.encode() + b"\n" + body)
    alloc = _alloc_on(path)
    assert alloc.live_ids() == {4}
    assert alloc.allocate([["davinci1-ctx0"]])[0].contexts == {"davinci1": 5}  # cursor kept
    assert path.read_bytes().startswith(b"v2 ")
    assert _alloc_on(path).live_ids() == {4, 5}


def test_a_switch_that_fails_after_the_rename_lays_out_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory fsync after the spare's rename fails: that Allocate is refused (nothing
    issued), and the next one is durable again."""
    from ember_runtime.durable import fsync_dir as real_fsync_dir

    monkeypatch.setattr(Checkpoint, "MIN_SPACE", 4096)
    monkeypatch.setattr(Checkpoint, "RECORDS_PER_LAYOUT", 8)
    switches = _count_switches(monkeypatch)
    path = tmp_path / "a.json"
    checkpoint = Checkpoint(path)
    alloc = ContextAllocator(checkpoint, id_space=100, node_ordinal=None)
    failing = {"armed": False}

    def fsync_dir(directory: Path) -> None:
        if failing["armed"]:
            failing["armed"] = False
            raise OSError("injected: directory fsync failed")
        real_fsync_dir(directory)

    monkeypatch.setattr("ember_runtime.deviceplugin.allocator.fsync_dir", fsync_dir)
    i = 0
    while not switches:
        if checkpoint._spare is not None:
            checkpoint._spare.join()
            failing["armed"] = True  # the next directory fsync is the switch's
        before = alloc.live_ids()
        try:
            alloc.allocate([[f"davinci{i % 4}-ctx{i % 2}"]])
        except OSError:
            assert alloc.live_ids() == before  # refused: nothing issued
            break
        i += 1
    else:
        raise AssertionError("the switch succeeded before the failure was injected")
    alloc.allocate([["davinci9-ctx0"]])
    assert _alloc_on(path).live_ids() == alloc.live_ids()
