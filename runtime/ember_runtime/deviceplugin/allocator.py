"""ACL context IDs: issued atomically, unique among live allocations, checkpointed.

Every Allocate gets one context ID per physical NPU it touches. An ID stays live until
PodResources shows that the container holding it is gone (see `reconcile`), and the live set is
checkpointed durably (see `Checkpoint`) *before* Allocate answers, so a plugin that is SIGKILLed
and restarted, or a node that reboots, never re-issues a live ID. IDs are issued round-robin from
a cursor that is checkpointed too, so a released ID is reused as late as possible.

With a node ordinal, IDs are `ordinal * id_space + n`: disjoint ranges, unique across the fleet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..durable import fsync_dir, write_all
from .discovery import parse_unit_id

log = logging.getLogger(__name__)


class AllocationError(Exception):
    """A request the allocator refuses (bad input); maps to INVALID_ARGUMENT."""


class ExhaustedError(AllocationError):
    """Every context ID is live; maps to RESOURCE_EXHAUSTED."""


class CheckpointError(Exception):
    """The checkpoint exists but cannot be trusted; starting empty could re-issue live IDs."""


@dataclass(frozen=True)
class Allocation:
    """The context IDs handed to one container, and what we know about its owner.

    Never changed once made (binding an owner makes a new one), so what is derived from it is
    computed once: every checkpoint write serialises every live allocation, and encoding a
    node's 64 of them afresh took 0.2 ms of the GIL per Allocate batch.
    """

    contexts: dict[str, int]  # device name -> global context ID
    units: list[str]  # the kubelet unit IDs of the container request
    created_at: float  # wall clock: it must mean the same after a restart
    owner: str | None = None  # "namespace/pod/container" once PodResources has shown it

    @cached_property
    def unit_set(self) -> frozenset[str]:
        return frozenset(self.units)

    @cached_property
    def encoded(self) -> bytes:
        """This allocation as a checkpoint record lists it (JSON)."""
        fields = {
            "contexts": self.contexts,
            "units": self.units,
            "created_at": self.created_at,
            "owner": self.owner,
        }
        return json.dumps(fields, separators=(",", ":")).encode()


@dataclass
class _State:
    cursor: int = 0
    allocations: list[Allocation] = field(default_factory=list)


class Checkpoint:
    """The allocator's state on disk: a log of checksummed snapshots, one durable write each.

    Each save is one `pwrite` of a line `v2 <sha256 of body> <body>` into space the log already
    holds (zeros written and fsync'd when the log was laid out), on a descriptor opened with
    O_DSYNC: the write returns once the bytes are on the device, and since it neither grows the
    file nor creates one, no metadata has to follow. That is one device flush per Allocate batch
    where a temp file, fsync, rename and directory fsync cost two flushes and four more system
    calls (measured on this machine kind: 0.12 vs 0.7 ms median). The newest valid record is
    the state. When the space is used up, the log continues in a spare a helper thread laid out
    (zeros, fsync) while the current one filled: the record goes durably to its start, then the
    rename and a directory fsync. When no spare is ready (or the file is new, or of the
    version-1 format, written whole on every save), the log is laid out the old way: a temp
    file holding the current record and zeros, fsync, rename, directory fsync.

    A crash during a pwrite can leave the last record torn: it was never acknowledged (Allocate
    answers after the write returns), so it is dropped, and the next save lays the log out
    afresh. A bad record with a record or any other bytes after it is corruption, not a tear:
    the plugin refuses to start rather than guess which IDs are live.
    """

    # Space for this many records of the current size (at least MIN_SPACE bytes) per log. Laying
    # one out costs about as much as one old-style save up to ~512 KiB and grows with the size
    # after that (here: 1.3 ms median at 512 KiB, 3.3 ms at 2 MiB with outliers to 57 ms), and a
    # layout on the write path (the first, or a spare not ready in time) holds up every Allocate
    # in flight: many small logs, not few big ones. A node of 16 NPUs x 4 contexts writes
    # 6.6 KB records: 420 KB every 64 batches.
    RECORDS_PER_LAYOUT = 64
    MIN_SPACE = 64 << 10

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._offset = 0  # where the next record goes
        self._space = 0  # bytes of zeros laid out from offset 0
        # The next log, laid out by a helper thread once this one is half used, so that running
        # out of space costs a record's write, a rename and a directory fsync, not also the
        # zeros and their fsync (0.4 MB for a full node: the slowest Allocate of every 64).
        self._spare: threading.Thread | None = None
        self._spare_space = 0  # bytes laid out in the spare, once it is ready (0: not ready)

    def load(self) -> _State:
        """The state as stored, its checksum checked (CheckpointError if it cannot be trusted)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _State()
        try:
            if raw.startswith(b"{"):
                return _state_of(_v1_body(raw))
            return _state_of(_last_record(raw))
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {self.path} is not usable: {exc}") from exc
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {self.path} is corrupt: {exc!r}") from exc

    def save(self, state: _State) -> None:
        """The state is on the device when this returns; raises OSError if it is not."""
        record = _record(state)
        if self._fd is None or self._offset + len(record) > self._space:
            if not self._switch_to_spare(record):
                self._lay_out(record)
            return
        try:
            _pwrite_all(self._fd, record, self._offset, self.path)
        except BaseException:
            self.close()  # a part of the record may be there: the next save lays out anew
            raise
        self._offset += len(record)
        if self._spare is None and 2 * self._offset > self._space:
            self._prepare_spare(self._space_for(record))

    def close(self) -> None:
        self._drop_spare()
        self._close_log()

    def _close_log(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._offset, self._space = None, 0, 0

    def _space_for(self, record: bytes) -> int:
        return max(self.MIN_SPACE, len(record) * self.RECORDS_PER_LAYOUT)

    @property
    def _spare_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.next")

    def _prepare_spare(self, space: int) -> None:
        def lay_out() -> None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _write_synced(self._spare_path, bytes(space))
                self._spare_space = space
            except OSError as exc:  # the write path lays out the old way instead
                log.warning("could not lay out the next checkpoint log: %s", exc)

        self._spare = threading.Thread(target=lay_out, name="checkpoint-spare", daemon=True)
        self._spare.start()

    def _drop_spare(self) -> None:
        if self._spare is not None:
            self._spare.join()
            self._spare_path.unlink(missing_ok=True)
        self._spare, self._spare_space = None, 0

    def _switch_to_spare(self, record: bytes) -> bool:
        """Continue in the laid-out spare: `record` durably at its start, then the rename and
        its directory fsync. False (nothing changed) when no spare is ready or fits."""
        spare = self._spare
        if spare is None or spare.is_alive():  # still being laid out: ready for the next time
            return False
        if len(record) > self._spare_space:  # grew past it (or its lay-out failed)
            self._drop_spare()
            return False
        space, path = self._spare_space, self._spare_path
        self._spare, self._spare_space = None, 0
        fd = os.open(path, os.O_WRONLY | os.O_DSYNC | os.O_CLOEXEC)
        try:
            _pwrite_all(fd, record, 0, path)
            os.replace(path, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            # The rename may have happened, and the current log is full either way: the next
            # save lays out anew (the descriptor closed here may name the replaced file).
            self._close_log()
            raise
        self._close_log()
        self._fd, self._offset, self._space = fd, len(record), space
        return True

    def _lay_out(self, record: bytes) -> None:
        self._close_log()
        space = self._space_for(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One fixed temp name: the allocator's lock serialises writers in this process, and a
        # SIGKILLed predecessor's leftover is simply truncated.
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            _write_synced(tmp, record + bytes(space - len(record)))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)  # make the rename itself durable
        # Synchronous for data from now on: records overwrite the laid-out zeros.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_DSYNC | os.O_CLOEXEC)
        self._offset, self._space = len(record), space


def _record(state: _State) -> bytes:
    allocations = b",".join(a.encoded for a in state.allocations)
    body = b'{"cursor":%d,"allocations":[%b]}' % (state.cursor, allocations)
    return b"v2 " + hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n"


def _last_record(raw: bytes) -> bytes:
    """The body of the newest valid record of a version-2 log (see `Checkpoint`)."""
    body: bytes | None = None
    at = 0
    while at < len(raw) and raw[at] != 0:  # zeros: space no record has used yet
        end = raw.find(b"\n", at)
        line = raw[at : len(raw) if end < 0 else end]
        magic, _, rest = line.partition(b" ")
        digest, _, candidate = rest.partition(b" ")
        if end < 0 or magic != b"v2" or hashlib.sha256(candidate).hexdigest().encode() != digest:
            if end >= 0 and raw[end + 1 :].strip(b"\0"):
                raise CheckpointError(f"bad record at byte {at} with more after it")
            log.warning("dropping a torn checkpoint record at byte %d (never acknowledged)", at)
            break
        body, at = candidate, end + 1
    if body is None:
        raise CheckpointError("no valid record")
    return body


def _v1_body(raw: bytes) -> bytes:
    """The body of a version-1 checkpoint (a header line with its checksum, then the body)."""
    header_line, _, body = raw.partition(b"\n")
    header = json.loads(header_line)
    if header.get("version") != 1:
        raise CheckpointError(f"unsupported checkpoint version {header.get('version')!r}")
    if header.get("checksum") != hashlib.sha256(body).hexdigest():
        raise CheckpointError("checksum mismatch")
    return body


def _state_of(body: bytes) -> _State:
    data = json.loads(body)
    allocations = [Allocation(**a) for a in data["allocations"]]
    return _State(cursor=int(data["cursor"]), allocations=allocations)


def _pwrite_all(fd: int, record: bytes, offset: int, path: Path) -> None:
    written = os.pwrite(fd, record, offset)
    if written != len(record):  # only a device error does this to a regular file
        raise OSError(f"short write to {path}: {written} of {len(record)} bytes")


def _write_synced(path: Path, payload: bytes) -> None:
    """`payload` as the whole of `path` (created 0600 or truncated), fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)


class ContextAllocator:
    """Thread-safe issuer of context IDs backed by a `Checkpoint`."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        id_space: int,
        node_ordinal: int | None,
        on_release: Callable[[list[Allocation]], None] | None = None,
    ) -> None:
        """`on_release` hears of allocations an Allocate superseded (called outside the lock)."""
        self._checkpoint = checkpoint
        self._on_release = on_release
        self._id_space = id_space
        self._base = (node_ordinal or 0) * id_space
        self._lock = threading.Lock()
        self._state = checkpoint.load()
        self._index()

    def _index(self) -> None:
        """Rebuild what is derived from the live allocations (after a load or a reconcile).

        An Allocate then updates both from its own batch alone: recomputing them over every
        live allocation (64 on a full node) cost more CPU than the rest of the call.
        """
        self._live = {cid for a in self._state.allocations for cid in a.contexts.values()}
        # unit -> the newest allocation naming it (the list is in issue order)
        self._holder = {unit: a for a in self._state.allocations for unit in a.units}

    def close(self) -> None:
        """Close the checkpoint's descriptor; a later write opens it again."""
        with self._lock:
            self._checkpoint.close()

    def live(self) -> list[Allocation]:
        with self._lock:
            return list(self._state.allocations)

    def live_ids(self) -> set[int]:
        with self._lock:
            return set(self._live)

    def used_by_device(self) -> dict[str, int]:
        with self._lock:
            used: dict[str, int] = defaultdict(int)
            for alloc in self._state.allocations:
                for device in alloc.contexts:
                    used[device] += 1
            return dict(used)

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[Allocation]:
        """Issue context IDs for each container request (a list of unit IDs), all or nothing.

        The checkpoint is on disk before this returns; if writing it fails nothing is issued.
        """
        result = self.allocate_batch([requests])[0]
        if isinstance(result, AllocationError):
            raise result
        return result

    def allocate_batch(
        self, batch: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[Allocation] | AllocationError]:
        """`allocate` for several Allocate calls under one checkpoint write (group commit).

        Each call is all or nothing on its own; a refused call gets its error in its slot.
        """
        gone: list[Allocation] = []
        with self._lock:
            cursor = self._state.cursor
            taken: set[int] = set()
            issued: list[Allocation] = []
            results: list[list[Allocation] | AllocationError] = []
            for requests in batch:
                try:
                    allocs, cursor = self._issue(requests, cursor, taken)
                except AllocationError as exc:
                    results.append(exc)
                    continue
                issued += allocs
                results.append(allocs)
                taken |= {cid for a in allocs for cid in a.contexts.values()}
            if issued:
                # The kubelet hands a unit out again only once the container holding it is
                # gone, so what the new allocations supersede goes in the same write: the
                # checkpoint (serialised on every Allocate) stays about a node's worth of units
                # long however fast pods churn, and its contexts are free at once.
                keep, gone, holder = self._supersede(issued)
                saved = _State(cursor, keep)
                self._checkpoint.save(saved)
                self._state, self._holder = saved, holder
                self._live.update(taken)  # then without what the batch superseded, itself too
                self._live.difference_update(c for a in gone for c in a.contexts.values())
        if gone and self._on_release is not None:
            self._on_release(gone)
        return results

    def _supersede(
        self, issued: list[Allocation]
    ) -> tuple[list[Allocation], list[Allocation], dict[str, Allocation]]:
        """(kept, superseded, the new unit index) once `issued` joins the live allocations.

        The same rule as `_without_superseded` (an allocation is superseded once newer ones
        took all its units), looked up through the unit index for the batch's units only.
        """
        holder = dict(self._holder)
        displaced: dict[int, Allocation] = {}
        for alloc in issued:
            for unit in alloc.units:
                old = holder.get(unit)
                if old is not None:
                    displaced[id(old)] = old
                holder[unit] = alloc
        gone = [a for a in displaced.values() if all(holder[u] is not a for u in a.units)]
        everything = [*self._state.allocations, *issued]
        if not gone:
            return everything, gone, holder
        dropped = {id(a) for a in gone}
        return [a for a in everything if id(a) not in dropped], gone, holder

    def _issue(
        self, requests: Sequence[Sequence[str]], cursor: int, taken: set[int]
    ) -> tuple[list[Allocation], int]:
        plans = [_devices_of(units) for units in requests]
        if not plans:
            raise AllocationError("AllocateRequest has no container requests")
        mine: set[int] = set()
        allocs = []
        for units, devices in zip(requests, plans, strict=True):
            contexts = {}
            for device in devices:
                cid, cursor = self._next_free(cursor, taken, mine)
                mine.add(cid)
                contexts[device] = cid
            allocs.append(Allocation(contexts, list(units), time.time()))
        return allocs, cursor

    def _next_free(self, cursor: int, taken: set[int], mine: set[int]) -> tuple[int, int]:
        for step in range(self._id_space):
            n = (cursor + step) % self._id_space
            cid = self._base + n
            if cid not in self._live and cid not in taken and cid not in mine:
                return cid, (n + 1) % self._id_space
        raise ExhaustedError(
            f"all {self._id_space} context IDs of this node are held by live allocations; "
            "they are released once PodResources shows their containers gone"
        )

    def reconcile(
        self,
        owners: Mapping[str, frozenset[str]],
        grace: float,
        listed_at: float | None = None,
        *,
        keep_missing: bool = False,
    ) -> list[Allocation]:
        """Release allocations whose containers are gone; return them.

        `owners` maps "namespace/pod/container" to the unit IDs PodResources reports for it.
        An allocation is bound to the container whose units cover its own the first time one
        shows up; it is released when that container disappears or no longer holds its units.
        One never seen is released when a newer allocation took all its units (superseded), or
        after `grace` seconds (the kubelet records the assignment only after Allocate returns,
        so a fresh allocation is not visible yet).

        `listed_at` is when the PodResources List was sent: only an allocation made before it
        may be bound, because an older snapshot can still show the unit's previous holder.

        `keep_missing`: the snapshot may leave out live containers (a kubelet that has just
        restarted and not yet re-admitted its pods), so a bound allocation whose container is
        absent is kept unless its units are now another container's or were allocated again.
        """
        now = time.time()
        listed_at = now if listed_at is None else listed_at
        with self._lock:
            keep, released = _partition(
                self._state.allocations, owners, now, grace, listed_at, keep_missing=keep_missing
            )
            if not released and keep == self._state.allocations:
                return []
            saved = _State(self._state.cursor, keep)
            self._checkpoint.save(saved)
            self._state = saved
            self._index()
        for alloc in released:
            log.info("released contexts %s of %s", alloc.contexts, alloc.owner or alloc.units)
        return released


def _devices_of(units: Sequence[str]) -> list[str]:
    if not units:
        raise AllocationError("a container request must name at least one device ID")
    if len(set(units)) != len(units):
        raise AllocationError(f"duplicate device IDs in request: {list(units)}")
    devices: list[str] = []
    for unit in units:
        try:
            device, _ = parse_unit_id(unit)
        except ValueError as exc:
            raise AllocationError(str(exc)) from exc
        if device not in devices:
            devices.append(device)
    return devices


def _without_superseded(
    allocations: Sequence[Allocation],
) -> tuple[list[Allocation], list[Allocation]]:
    """(kept, superseded): an allocation is superseded once newer ones took all its units."""
    keep: list[Allocation] = []
    gone: list[Allocation] = []
    newer_units: set[str] = set()
    for alloc in reversed(allocations):  # newest first, as in _partition
        (gone if alloc.unit_set <= newer_units else keep).append(alloc)
        newer_units |= alloc.unit_set
    keep.reverse()
    return keep, gone


def _partition(
    allocations: Sequence[Allocation],
    owners: Mapping[str, frozenset[str]],
    now: float,
    grace: float,
    listed_at: float,
    *,
    keep_missing: bool = False,
) -> tuple[list[Allocation], list[Allocation]]:
    keep: list[Allocation] = []
    held_by = {unit: owner for owner, units in owners.items() for unit in units}
    # The kubelet hands a unit out again only once the container holding it is gone, so an
    # allocation whose units were all allocated again later is superseded, bound or not.
    current, released = _without_superseded(allocations)
    claimed: set[str] = set()
    # Newest first (the list is in issue order; wall clocks can jump).
    for alloc in reversed(current):
        if alloc.owner is not None:
            held = alloc.unit_set <= owners.get(alloc.owner, frozenset())
            taken = any(held_by.get(u, alloc.owner) != alloc.owner for u in alloc.units)
            if held or (keep_missing and not taken):
                keep.append(alloc)
                claimed.add(alloc.owner)
            else:
                released.append(alloc)
        else:
            owner = _owner_of(alloc, owners, claimed) if alloc.created_at < listed_at else None
            if owner is not None:
                keep.append(Allocation(alloc.contexts, alloc.units, alloc.created_at, owner))
                claimed.add(owner)
            elif now - alloc.created_at < grace:
                keep.append(alloc)
            else:
                released.append(alloc)
    keep.reverse()
    return keep, released


def _owner_of(
    alloc: Allocation, owners: Mapping[str, frozenset[str]], claimed: set[str]
) -> str | None:
    return next(
        (o for o, units in owners.items() if o not in claimed and alloc.unit_set <= units), None
    )


def preferred_units(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """Choose `size` units from `available` for GetPreferredAllocation.

    Units of devices already in `must_include` come first (fewer devices per container); then
    whole devices in order of most free units, so a single unit lands on the least busy NPU and
    a multi-unit request spans as few NPUs as possible.
    """
    if size <= 0:
        raise AllocationError(f"allocation size must be positive, got {size}")
    pool = list(dict.fromkeys(available))
    missing = [u for u in must_include if u not in pool]
    if missing:
        raise AllocationError(f"must-include device IDs are not available: {missing}")
    if size > len(pool):
        raise AllocationError(f"{size} units requested but only {len(pool)} available")
    if len(must_include) > size:
        raise AllocationError("more must-include device IDs than the allocation size")
    free: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for unit in pool:
        try:
            device, slot = parse_unit_id(unit)
        except ValueError as exc:
            raise AllocationError(str(exc)) from exc
        if unit not in must_include:
            free[device].append((slot, unit))
    chosen = list(dict.fromkeys(must_include))
    anchored = {parse_unit_id(u)[0] for u in chosen}
    order = sorted(free, key=lambda d: (d not in anchored, -len(free[d]), _natural(d)))
    for device in order:
        for _, unit in sorted(free[device]):
            if len(chosen) == size:
                return chosen
            chosen.append(unit)
    return chosen


def _natural(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else -1, name)
