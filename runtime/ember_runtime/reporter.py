"""Reports the thermal state as a condition, on change only: coalesced, newest wins, retried.

`CoalescingReporter` is the machinery, parameterised by what is worth a write and how the
condition is built; `ConditionReporter` is the thermal one (a pod's or a node's), and the
runtime's `ember.dev/Health` condition (`server.health`) uses the same machinery. Part of the
shared layer: the runtime server (its pod's conditions) and the node agent (its Node's) both
run it; what it writes is the contract's (`contract.thermal`, `contract.rollout`).

Like the kubelet's status manager: the newest state lives in memory, one task writes it, and when
the API server is away the task retries with capped backoff and writes the newest state (not a
backlog) when it answers again.

When a state is worth a write (`worth_reporting`): the first one (a restarted container must
replace its predecessor's condition), a change of reason (Normal/Throttled/Critical/…), of the
batch limit or of the sensor problem (why a sensor gives no reading), or a temperature
`band_celsius` away from the last written one. The band is centred on the last written value
rather than fixed edges, so a reading wobbling on an edge never writes twice; the operator uses
it for TEMP, `/metrics` has the live value.

Joules per output token rides along: every write carries the newest figure, but a change of it
alone (two significant digits, `contract.thermal.report_joules`) is worth a write only when it
moved `JOULES_BAND` (10 %) from the written figure, or appeared or went away, and the last write
of any kind is `joules_interval` (60 s) old. So it costs at most one extra write per pod a
minute, and none under a steady load (the figure stays within its band) or while other changes
write anyway; the live value is on `/metrics`.

Rate: at most one write per `min_interval` (2 s by default). A ramp of 1 °C/s with 2 °C steps
changes the batch every 2 s at most, so coalescing loses no step of a real ramp; it bounds a
pathological sensor to 0.5 writes/s per pod (500/s at 1,000 pods would still be too many, which is
why the band and the change-only rule come first: a steady fleet writes nothing). Backoff starts
at 0.5 s and is capped at 4 s, so the newest state lands within ~4 s of the API server's return,
well inside the 10 s the operator's status may lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ember_runtime.contract.thermal import ThermalReading, thermal_condition

log = logging.getLogger(__name__)

MIN_INTERVAL_SECONDS = 2.0
JOULES_INTERVAL_SECONDS = 60.0
JOULES_BAND = 0.1  # relative to the written figure
BACKOFF_INITIAL_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 4.0
S = TypeVar("S")  # the state a condition is written from


class ConditionWriter(Protocol):
    async def write(self, condition: dict[str, Any]) -> None: ...


def worth_reporting(last: ThermalReading | None, new: ThermalReading, band: float) -> bool:
    if last is None:
        return True
    if (last.reason, last.max_batch_size, last.capacity, last.detail) != (
        new.reason,
        new.max_batch_size,
        new.capacity,
        new.detail,
    ):
        return True
    if (last.temperature_celsius is None) != (new.temperature_celsius is None):
        return True
    if last.temperature_celsius is None or new.temperature_celsius is None:
        return False
    return abs(new.temperature_celsius - last.temperature_celsius) >= band


def joules_moved(last: float | None, new: float | None, band: float = JOULES_BAND) -> bool:
    """Whether a J/token figure moved enough from the written one to be worth a write by itself
    (appearing and going away count)."""
    if last is None or new is None:
        return (last is None) != (new is None)
    return new != last and abs(new - last) >= band * last


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class CoalescingReporter(Generic[S]):
    """One condition kept on one object: the newest state `S` in memory, written by one task when
    `worth(last written, new)` says so, at most once per `min_interval`, retried with capped
    backoff. `condition(state, now)` builds the condition; its lastTransitionTime moves only when
    its `status` does. The thermal condition (`ConditionReporter`) and the runtime's
    `ember.dev/Health` (`server.health`) are written by it."""

    def __init__(
        self,
        writer: ConditionWriter,
        *,
        worth: Callable[[S | None, S], bool],
        condition: Callable[[S, str], dict[str, Any]],
        what: str,
        min_interval: float,
        backoff_initial: float = BACKOFF_INITIAL_SECONDS,
        backoff_cap: float = BACKOFF_CAP_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._writer, self._worth, self._build, self._what = writer, worth, condition, what
        self._min_interval, self._clock = min_interval, clock
        self._backoff_initial, self._backoff_cap = backoff_initial, backoff_cap
        self._written: S | None = None
        self._pending: S | None = None
        self._since: str | None = None  # lastTransitionTime of the written status
        self._status: str | None = None  # the written status
        self._last_write = float("-inf")
        self._wake = asyncio.Event()
        self.writes = 0
        self.failures = 0

    @property
    def written(self) -> S | None:
        return self._written

    def since_write(self) -> float:
        """Seconds since the last write landed (infinite before the first)."""
        return self._clock() - self._last_write

    @property
    def pending(self) -> S | None:
        return self._pending

    def offer(self, state: S) -> None:
        """The newest state; queued only if it is worth a write against the last written one."""
        if self._worth(self._written, state):
            self._pending = state
            self._wake.set()
        else:
            self._pending = None  # back where the written condition already says: nothing to do

    def _condition(self, state: S) -> dict[str, Any]:
        cond = self._build(state, _now())
        if self._written is not None and self._status == cond["status"] and self._since:
            cond["lastTransitionTime"] = self._since  # moves only when status flips
        return cond

    async def _write_pending(self) -> None:
        """Write the newest pending state once; retry with capped backoff until it lands."""
        delay = self._backoff_initial
        while (state := self._pending) is not None:
            wait = self._last_write + self._min_interval - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # a newer state may have arrived meanwhile: take that one
            cond = self._condition(state)
            try:
                await self._writer.write(cond)
            except Exception as exc:  # any failure is retried; the log says which
                self.failures += 1
                log.warning(
                    "%s condition not written (retry in %.1fs): %s: %s",
                    self._what,
                    delay,
                    type(exc).__name__,  # a timeout's own text is empty
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(self._backoff_cap, delay * 2)
                continue
            self.writes += 1
            self._last_write = self._clock()
            self._written, self._since = state, cond["lastTransitionTime"]
            self._status = cond["status"]
            if self._pending is state:
                self._pending = None
            delay = self._backoff_initial

    async def run(self) -> None:
        """Until cancelled: wake on each new state worth writing, write the newest."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_pending()

    async def flush(self, timeout: float) -> bool:
        """Best effort at shutdown: write what is pending if the API server answers in time."""
        if self._pending is None:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._write_pending(), timeout)
        return self._pending is None


class ConditionReporter(CoalescingReporter[ThermalReading]):
    """The `ember.dev/Thermal` condition (a pod's or a node's). `band_celsius` may change while
    it runs (a reloaded policy)."""

    def __init__(
        self,
        writer: ConditionWriter,
        *,
        band_celsius: float,
        min_interval: float = MIN_INTERVAL_SECONDS,
        backoff_initial: float = BACKOFF_INITIAL_SECONDS,
        backoff_cap: float = BACKOFF_CAP_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        joules_interval: float = JOULES_INTERVAL_SECONDS,
    ) -> None:
        super().__init__(
            writer,
            worth=self._worth_reporting,
            condition=thermal_condition,
            what="thermal",
            min_interval=min_interval,
            backoff_initial=backoff_initial,
            backoff_cap=backoff_cap,
            clock=clock,
        )
        self.band_celsius = band_celsius
        self.joules_interval = joules_interval

    def _worth_reporting(self, last: ThermalReading | None, new: ThermalReading) -> bool:
        if worth_reporting(last, new, self.band_celsius):
            return True
        return (
            last is not None
            and self.since_write() >= self.joules_interval
            and joules_moved(last.joules_per_token, new.joules_per_token)
        )
