"""Find NPU device nodes (and the shared control nodes) under a configurable root.

Hardware sits behind the `DeviceSource` protocol. The real implementation only globs and stats
paths, so tests drive the real code with plain files in a temp dir standing in for `/dev`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_TRAILING_INDEX = re.compile(r"(\d+)$")
UNIT_SEPARATOR = "-ctx"


@dataclass(frozen=True, order=True)
class NpuDevice:
    """One physical NPU: `davinci3` at `/dev/davinci3` has index 3."""

    index: int
    name: str
    path: Path


class DeviceSource(Protocol):
    """What the plugin needs from the hardware side."""

    def scan(self) -> list[NpuDevice]:
        """The NPUs whose device nodes exist now, sorted by index."""
        ...

    def control_nodes(self) -> list[Path]:
        """The shared control nodes that exist now."""
        ...

    def watch_dir(self) -> Path:
        """The directory whose changes may change `scan()` (watched with inotify)."""
        ...


class DevNodeDiscovery:
    """Device nodes matching `glob` under `root`; names must end in the device index."""

    def __init__(self, root: Path, glob: str, control: list[str]) -> None:
        self._root = root
        self._glob = glob
        self._control = control
        self._warned: set[str] = set()
        self._control_found: list[Path] | None = None

    def scan(self) -> list[NpuDevice]:
        self._control_found = None  # looked up again on the next Allocate
        found = []
        for path in self._root.glob(self._glob):
            match = _TRAILING_INDEX.search(path.name)
            if match is None:
                if path.name not in self._warned:  # say it once, not every rescan
                    self._warned.add(path.name)
                    log.warning("ignoring %s: device node names must end in an index", path)
                continue
            found.append(NpuDevice(index=int(match.group(1)), name=path.name, path=path))
        return sorted(found)

    def control_nodes(self) -> list[Path]:
        # Every Allocate asks; the answer changes only with the device nodes, which every
        # (inotify-driven or periodic) scan re-reads, so look once per scan, not per call.
        if self._control_found is None:
            self._control_found = [
                self._root / name for name in self._control if (self._root / name).exists()
            ]
        return self._control_found

    def watch_dir(self) -> Path:
        return self._root


def unit_id(device: NpuDevice | str, slot: int) -> str:
    """The kubelet-visible ID of one schedulable unit: context slot `slot` of `device`."""
    name = device if isinstance(device, str) else device.name
    return f"{name}{UNIT_SEPARATOR}{slot}"


def parse_unit_id(unit: str) -> tuple[str, int]:
    """`davinci0-ctx2` → (`davinci0`, 2); ValueError for anything else."""
    name, sep, slot = unit.rpartition(UNIT_SEPARATOR)
    if not sep or not name or not slot.isdigit():
        raise ValueError(f"{unit!r} is not an ember NPU unit ID (<device>{UNIT_SEPARATOR}<n>)")
    return name, int(slot)
