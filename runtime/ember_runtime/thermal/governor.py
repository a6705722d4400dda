"""The runtime's own thermal governor: every sensor sample → the batch limit in force.

No network between the sensor and the engine: the sampler calls `Governor.apply` with the
smoothed hottest reading (EWMA: rising readings count at once, falling ones are smoothed), the
policy from the ConfigMap turns it into a limit, and the engine gets it before the next decode
step. `PUT /admin/batch` sets a manual override that can lower the limit (never raise it above
the policy's value at the current temperature) until it expires; the policy alone decides again
at the first sample after that.

The governor is handed the config's `BatchLimits` (`RuntimeConfig.limits()`: the policy applied
to `engine.maxBatchSize`, the one rendered ceiling) and nothing else about the batch: it does not
ask the engine for its capacity nor take a ceiling of its own. Every decision it makes goes out
through its two callbacks, the limit to the engine and the report (`ThermalReading`) to whoever
writes the condition, so no caller carries its state onward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ember_runtime.contract.thermal import (
    REASON_NO_READING,
    REASON_SENSOR_UNAVAILABLE,
    BatchLimits,
    ThermalPolicy,
    ThermalReading,
    ThermalReason,
    whole_degrees,
)

log = logging.getLogger(__name__)

DEFAULT_OVERRIDE_SECONDS = 600.0
MAX_OVERRIDE_SECONDS = 86_400.0


@dataclass(frozen=True)
class Override:
    batch: int
    until: float  # monotonic


@dataclass(frozen=True)
class GovernorState:
    temperature_celsius: float | None
    batch: int
    capacity: int
    reason: ThermalReason
    override: Override | None
    sensor_problem: str | None = None  # why a configured sensor gives no reading
    shedding: bool = False  # the ladder's second step: new work to cooler peers

    def reading(self) -> ThermalReading:
        return ThermalReading(
            reason=self.reason,
            temperature_celsius=whole_degrees(self.temperature_celsius),
            max_batch_size=self.batch,
            capacity=self.capacity,
            detail=self.sensor_problem,
        )


class Governor:
    """Holds the policy (reloadable), the batch in force and an optional manual override.

    `apply` runs on the sampler's schedule; `set_override`/`set_policy` come from HTTP handlers
    and the config reloader, so state changes go through one lock.
    """

    def __init__(
        self,
        limits: BatchLimits,
        set_batch: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        *,
        report: Callable[[ThermalReading], None] | None = None,
    ) -> None:
        self._set_batch, self._report, self._clock = set_batch, report, clock
        self._lock = threading.Lock()
        self._limits = limits
        self._batch = limits.max_batch_size  # in force
        # The policy's own value, kept up to date under an override too, so the policy resumes
        # from its own hysteresis state (not from the override's value) when that expires.
        self._policy_batch = self._batch
        self._temp: float | None = None
        self._sensor_problem: str | None = None
        self._override: Override | None = None
        self._shedding = False
        set_batch(self._batch)  # the first limit: the engine and the governor agree from here

    @property
    def limits(self) -> BatchLimits:
        return self._limits

    @property
    def capacity(self) -> int:
        return self._limits.max_batch_size

    def set_policy(self, policy: ThermalPolicy) -> GovernorState:
        """A reloaded `thermal:` section; the ceiling stays the engine's (a changed
        `engine.maxBatchSize` restarts the pod: it is in the config hash)."""
        with self._lock:
            self._limits = policy.limits(self.capacity)
        log.info("thermal policy reloaded: %s", policy.model_dump(by_alias=True))
        return self.apply(self._temp, self._sensor_problem)

    def set_override(self, batch: int, seconds: float) -> GovernorState:
        if not 1 <= batch <= self.capacity:
            raise ValueError(f"maxBatchSize must be within 1..{self.capacity}, got {batch}")
        if not 0 < seconds <= MAX_OVERRIDE_SECONDS:
            raise ValueError(f"expiresInSeconds must be within (0, {MAX_OVERRIDE_SECONDS:.0f}]")
        with self._lock:
            self._override = Override(batch, self._clock() + seconds)
        return self.apply(self._temp, self._sensor_problem)

    def clear_override(self) -> GovernorState:
        with self._lock:
            self._override = None
        return self.apply(self._temp, self._sensor_problem)

    def apply(self, temp: float | None, sensor_problem: str | None = None) -> GovernorState:
        """One sample: decide the limit, hand it to the engine if it changed, and the state to
        the reporter (which writes only what is worth a write). `sensor_problem`: why a
        configured sensor gave no reading (it goes into the reported state)."""
        with self._lock:
            self._temp, self._sensor_problem = temp, sensor_problem
            override = self._override
            if override is not None and self._clock() >= override.until:
                log.info("manual batch override %d expired", override.batch)
                self._override = override = None
            self._policy_batch = self._limits.next_batch(temp, self._policy_batch)
            shedding = self._limits.shedding(temp, self._shedding)
            if shedding != self._shedding:
                log.info("thermal: %s °C, shedding %s", _fmt(temp), "on" if shedding else "off")
            self._shedding = shedding
            # An override sheds load; it never lifts the batch above what the policy allows at
            # this temperature (threat model: the thermal floor is not a client's to remove).
            wanted = self._policy_batch
            if override is not None:
                wanted = min(override.batch, wanted)
            changed, before = wanted != self._batch, self._batch
            self._batch = wanted
            state = self._state_locked()
        if changed:
            self._set_batch(wanted)  # outside the lock: the engine takes its own
            log.info("thermal: %s °C, batch %d -> %d", _fmt(temp), before, wanted)
        if self._report is not None:
            self._report(state.reading())
        return state

    def state(self) -> GovernorState:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> GovernorState:
        reason = self._limits.reason(self._temp, self._batch, self._shedding)
        if reason == REASON_NO_READING and self._sensor_problem:
            reason = REASON_SENSOR_UNAVAILABLE  # not just "no reading": a sensor is broken
        return GovernorState(
            temperature_celsius=self._temp,
            batch=self._batch,
            capacity=self.capacity,
            reason=reason,
            override=self._override,
            sensor_problem=self._sensor_problem,
            shedding=self._shedding,
        )


def _fmt(temp: float | None) -> str:
    return "?" if temp is None else f"{temp:.1f}"
