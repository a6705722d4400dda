"""Turn device discovery and an optional health command into a stream of device states.

A device is healthy while its node exists and the health command (if any) exits 0 for it. Known
devices are never forgotten: a vanished node is reported Unhealthy, and Healthy again when it
comes back, so nothing stays unhealthy until a restart (NVIDIA k8s-device-plugin #234/#1014).
Changes are noticed by inotify on the device directory at once and by a periodic rescan as a
fallback; each change bumps `HealthMonitor.version` and wakes every ListAndWatch stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from inotify_simple import INotify
from inotify_simple import flags as inflags

from .discovery import DeviceSource, NpuDevice

log = logging.getLogger(__name__)

_DIR_EVENTS = (
    inflags.CREATE | inflags.DELETE | inflags.MOVED_FROM | inflags.MOVED_TO | inflags.ATTRIB
)


@dataclass(frozen=True)
class DeviceState:
    device: NpuDevice
    present: bool
    probe_ok: bool

    @property
    def healthy(self) -> bool:
        return self.present and self.probe_ok


class CommandProbe:
    """Runs `argv` once per device (no shell); `{index}`, `{name}`, `{path}` are substituted.

    Exit 0 means healthy. A timeout or a command that cannot start counts as unhealthy: a
    misconfigured probe should be visible, not silently ignored.
    """

    def __init__(self, argv: Sequence[str], timeout: float) -> None:
        if not argv:
            raise ValueError("health command must not be empty")
        self._argv = list(argv)
        self._timeout = timeout

    def _render(self, device: NpuDevice) -> list[str]:
        values = {"index": str(device.index), "name": device.name, "path": str(device.path)}
        return [arg.format_map(values) for arg in self._argv]

    async def check(self, device: NpuDevice) -> bool:
        argv = self._render(device)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
        except OSError as exc:
            log.error("health command %s cannot start: %s", argv[0], exc)
            return False
        try:
            code = await asyncio.wait_for(proc.wait(), self._timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            log.warning("health command timed out for %s", device.name)
            return False
        return code == 0


class HealthMonitor:
    """Keeps the current state of every known device and signals changes."""

    def __init__(
        self,
        source: DeviceSource,
        probe: CommandProbe | None,
        rescan_interval: float,
        probe_interval: float,
    ) -> None:
        self._source = source
        self._probe = probe
        self._rescan_interval = rescan_interval
        self._probe_interval = probe_interval
        self._states: dict[str, DeviceState] = {}
        self._probe_ok: dict[str, bool] = {}
        self._changed = asyncio.Event()
        self._rescan_now = asyncio.Event()
        self.version = 0
        self.rescan()

    def states(self) -> list[DeviceState]:
        return sorted(self._states.values(), key=lambda s: s.device)

    def device(self, name: str) -> DeviceState | None:
        return self._states.get(name)

    def rescan(self) -> bool:
        """Re-read the device nodes; return True (and wake waiters) when anything changed."""
        present = {d.name: d for d in self._source.scan()}
        new = {
            name: DeviceState(old.device, name in present, self._probe_ok.get(name, True))
            for name, old in self._states.items()
        }
        for name, device in present.items():
            new[name] = DeviceState(device, True, self._probe_ok.get(name, True))
        if new == self._states:
            return False
        for name, state in new.items():
            before = self._states.get(name)
            if before is None or before.healthy != state.healthy:
                log.info("device %s is %s", name, "healthy" if state.healthy else "unhealthy")
        self._states = new
        self.version += 1
        # Broadcast: wake everyone waiting on the current event, then start a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def wait_change(self, seen_version: int) -> int:
        """Return once `version` differs from `seen_version`; returns the new version."""
        while self.version == seen_version:
            await self._changed.wait()
        return self.version

    async def run(self) -> None:
        """Rescan on inotify events and periodically; probe periodically. Runs until cancelled."""
        tasks = [asyncio.create_task(self._rescan_loop())]
        if self._probe is not None:
            tasks.append(asyncio.create_task(self._probe_loop(self._probe)))
        inotify = self._start_inotify()
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if inotify is not None:
                asyncio.get_running_loop().remove_reader(inotify.fileno())
                inotify.close()

    def _start_inotify(self) -> INotify | None:
        watch_dir = self._source.watch_dir()
        inotify = INotify(nonblocking=True)
        try:
            inotify.add_watch(os.fspath(watch_dir), _DIR_EVENTS)
        except OSError as exc:
            log.warning("cannot watch %s (%s); relying on periodic rescans", watch_dir, exc)
            inotify.close()
            return None

        def on_events() -> None:
            with contextlib.suppress(BlockingIOError):
                inotify.read()
            self._rescan_now.set()

        asyncio.get_running_loop().add_reader(inotify.fileno(), on_events)
        return inotify

    async def _rescan_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rescan_now.wait(), self._rescan_interval)
            self._rescan_now.clear()
            self.rescan()

    async def _probe_loop(self, probe: CommandProbe) -> None:
        while True:
            devices = [s.device for s in self._states.values() if s.present]
            results = await asyncio.gather(*(probe.check(d) for d in devices))
            for device, ok in zip(devices, results, strict=True):
                self._probe_ok[device.name] = ok
            self.rescan()
            await asyncio.sleep(self._probe_interval)
