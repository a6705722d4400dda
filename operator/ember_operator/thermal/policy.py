"""The thermal policy: temperature → allowed batch size, and when a node must be vacated. Pure.

Batch size (per replica)::

    T <  throttle : maxBatch
    T >= throttle : clamp(maxBatch − floor((T − throttle) / step), minBatch, maxBatch)

with hysteresis on the way back up, so a reading that wobbles around a step edge does not flap
the batch (each change costs a scheduling hiccup in the runtime): the batch grows only to what a
reading `hysteresis` °C hotter would allow, and returns to the full batch only once
T < throttle − hysteresis. Shrinking is never delayed: heat is what hurts p99.

Example (throttle 78, step 2, max 16, min 4, hysteresis 3): 84 °C → 13; cooling, 82 → 13,
80 → 14, 77 → 15, 75 → 15, 74.9 → 16.

Node heat (per node): a node whose hottest replica stays ≥ critical for `criticalForSeconds`
must be vacated (taint + evict); a vacated node is released once a reading shows it below
throttle − hysteresis, or — since its replicas are gone and nothing else reports its
temperature — after `probe_after` seconds without readings: a replica lands again and measures;
if the node is still critical the window runs again.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ember_operator.api.models import InferenceDeploymentSpec, ThermalPolicy

DEFAULT_HYSTERESIS_CELSIUS = 3.0
DEFAULT_PROBE_AFTER_SECONDS = 300.0


@dataclass(frozen=True)
class ThermalLimits:
    max_batch: int = 16
    min_batch: int = 4
    throttle_celsius: float = 78.0
    critical_celsius: float = 90.0
    celsius_per_step: float = 2.0
    critical_for_seconds: float = 60.0
    hysteresis_celsius: float = DEFAULT_HYSTERESIS_CELSIUS
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"need 1 <= minBatch ({self.min_batch}) <= maxBatch ({self.max_batch})"
            )
        if self.celsius_per_step <= 0 or self.hysteresis_celsius < 0:
            raise ValueError("celsiusPerStep must be > 0 and hysteresis >= 0")
        if self.critical_celsius <= self.throttle_celsius:
            raise ValueError("criticalCelsius must be greater than throttleCelsius")

    @classmethod
    def from_spec(cls, spec: InferenceDeploymentSpec) -> ThermalLimits:
        t = spec.thermal
        return cls(
            max_batch=spec.engine.max_batch_size,
            min_batch=spec.engine.min_batch_size,
            throttle_celsius=float(t.throttle_celsius),
            critical_celsius=float(t.critical_celsius),
            celsius_per_step=float(t.celsius_per_step),
            critical_for_seconds=float(t.critical_for_seconds),
            adaptive=t.policy == ThermalPolicy.ADAPTIVE,
        )

    @property
    def release_celsius(self) -> float:
        """Below this the full batch returns and a vacated node is released."""
        return self.throttle_celsius - self.hysteresis_celsius


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def batch_for(temp: float, limits: ThermalLimits) -> int:
    """The memoryless formula (no hysteresis)."""
    if temp < limits.throttle_celsius:
        return limits.max_batch
    steps = math.floor((temp - limits.throttle_celsius) / limits.celsius_per_step)
    return _clamp(limits.max_batch - steps, limits.min_batch, limits.max_batch)


def max_batch(temp: float | None, limits: ThermalLimits, current: int | None) -> int:
    """The batch size a replica at `temp` °C, now allowed `current`, should be allowed."""
    if not limits.adaptive or temp is None or math.isnan(temp):
        return limits.max_batch  # no policy or no sensor: serve at full size
    target = batch_for(temp, limits)
    if current is None:
        return target
    current = _clamp(current, limits.min_batch, limits.max_batch)
    if target <= current:
        return target  # hotter (or unchanged): shrink at once
    if temp < limits.release_celsius:
        return limits.max_batch
    # Cooling inside the band: grow only as far as a reading `hysteresis` hotter allows,
    # and never to the full batch (that needs T < throttle − hysteresis).
    cautious = min(batch_for(temp + limits.hysteresis_celsius, limits), limits.max_batch - 1)
    return _clamp(max(current, cautious), limits.min_batch, limits.max_batch)


class NodeVerdict(enum.Enum):
    OK = "ok"  # nothing to do
    WATCH = "watch"  # critical, window still running
    VACATE = "vacate"  # critical for the whole window: taint the node, evict the replica
    HOLD = "hold"  # tainted, not cool enough yet
    RELEASE = "release"  # tainted and cool (or unobserved for long): remove the taint


@dataclass
class NodeHeat:
    """Per-node critical-since timestamps and taint state; time is injected (monotonic s).

    One instance per operator (node heat is shared by every InferenceDeployment); rebuild the
    tainted set at start from the nodes' taints with `adopt`.
    """

    probe_after_seconds: float = DEFAULT_PROBE_AFTER_SECONDS
    critical_since: dict[str, float] = field(default_factory=dict)
    tainted: dict[str, float] = field(default_factory=dict)  # node -> last reading time

    def adopt(self, node: str, now: float) -> None:
        """A node found tainted (e.g. after an operator restart)."""
        self.tainted.setdefault(node, now)

    def observe(self, node: str, temp: float, limits: ThermalLimits, now: float) -> NodeVerdict:
        if node in self.tainted:
            self.tainted[node] = now
        if temp >= limits.critical_celsius and limits.adaptive:
            since = self.critical_since.setdefault(node, now)
            if now - since >= limits.critical_for_seconds:
                return NodeVerdict.VACATE
            return NodeVerdict.HOLD if node in self.tainted else NodeVerdict.WATCH
        self.critical_since.pop(node, None)
        if node in self.tainted:
            return NodeVerdict.RELEASE if temp < limits.release_celsius else NodeVerdict.HOLD
        return NodeVerdict.OK

    def stale(self, now: float) -> list[str]:
        """Tainted nodes nobody has reported on for `probe_after_seconds`: release to re-probe."""
        return sorted(n for n, t in self.tainted.items() if now - t >= self.probe_after_seconds)

    def mark_tainted(self, node: str, now: float) -> None:
        self.tainted[node] = now

    def mark_released(self, node: str) -> None:
        self.tainted.pop(node, None)
        self.critical_since.pop(node, None)
