"""Thermal control's contract: the defaults, the policy, its arithmetic, and the report.

- `ThermalPolicy`: the ConfigMap's `thermal:` section. Its field defaults are Ember's one set
  of thermal defaults: the CRD (`ember_operator.api.models`), the node agent's settings and the
  runtime read them here, and a test holds the chart's values to them.
- `BatchLimits`: the policy applied to an engine's capacity (the `engine.maxBatchSize` it
  allocated for). The batch ceiling is rendered once, in the engine section, and reaches the
  policy only here: the thermal section has no batch maximum of its own to disagree with it.
- `ThermalReading`: what the runtime (on its Pod) and the node agent (on its Node) report in
  the `ember.dev/Thermal` condition, typed. `thermal_condition` encodes it, `decode_report`
  (through `parse_thermal_condition`) decodes it: the condition's message is the human line
  (`84 °C, batch 13/16`) followed by one line `REPORT_PREFIX` + JSON, the same values as data.

Why JSON in the message and not an annotation written in the same patch: the message is one
field of the one condition the admission policy already lets a runtime's and an agent's token
write (charts/ember/templates/thermal-admission.yaml), so that policy stays exactly as strict as
it was (labels and annotations untouchable); the data and the sentence people read travel in the
same field of the same object, so they can never come from two different writes; and the node
agent writes the same condition on a Node, where an annotation would need a second policy hole.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal, Self

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic import model_validator as _model_validator
from pydantic.alias_generators import to_camel
from pydantic.dataclasses import dataclass

from ember_runtime.contract.wire import Wire

# The condition the runtime keeps on its own Pod (and the node agent on its Node). Its status is
# "True" while the replica is thermally limited (batch below max, or critical).
THERMAL_CONDITION = "ember.dev/Thermal"
REASON_NORMAL: Final = "Normal"
REASON_THROTTLED: Final = "Throttled"
REASON_CRITICAL: Final = "Critical"
REASON_NO_READING: Final = "NoReading"
# No reading because a configured sensor cannot work here (no NVML driver, no npu-smi, no
# sysfs): the message says which and why, so `kubectl describe` answers "why no temperature?".
REASON_SENSOR_UNAVAILABLE: Final = "SensorUnavailable"
REASON_POLICY_OFF: Final = "PolicyOff"
ThermalReason = Literal[
    "Normal", "Throttled", "Critical", "NoReading", "SensorUnavailable", "PolicyOff"
]
LIMITED_REASONS = frozenset({REASON_THROTTLED, REASON_CRITICAL})
# Condition messages are read by people (`kubectl describe`); a library's error can be long.
MAX_DETAIL = 300
# The machine-readable line of the message: after the last newline (JSON has no raw newline, so
# a sensor's error text, however odd, can never end the human part early), behind this prefix.
REPORT_PREFIX = "ember.dev/thermal.v1 "
MAX_BATCH = 256  # the CRD's bound on engine.maxBatchSize
# A batch size wherever it travels: the spec's engine.maxBatchSize/minBatchSize, the runtime
# config's, the policy's floor, a report's batch and capacity. One type, one set of bounds.
Batch = Annotated[int, Field(ge=1, le=MAX_BATCH)]

# ----------------------------------------------------------------------------- defaults
DEFAULT_MAX_BATCH_SIZE = 16
DEFAULT_MIN_BATCH_SIZE = 4


class ThermalPolicy(Wire):
    """Temperature → batch limit, applied by the runtime at every sample (`BatchLimits`).

        Batch limit, for an engine allocated for `capacity` sequences::

            T <  throttle : capacity
            T >= throttle : clamp(capacity − floor((T − throttle) / step), minBatch, capacity)
            T >= critical : minBatch, and shedding

    That is the step-down ladder: first the batch, step by step; at `critical` the batch is at its
    floor and the replica sheds: its reason turns Critical, and the site gateway sends new work to
    its cooler peers (it takes work only when no peer is live), until T < critical − hysteresis.
    The operator moves a replica that stays Critical for `critical_for_seconds` off its node.

        with hysteresis on the way back up, so a reading that wobbles around a step edge does not
        flap the batch (each change costs a scheduling hiccup): the batch grows only to what a
        reading `hysteresis` °C hotter would allow, and returns to the full batch only once
        T < throttle − hysteresis. Shrinking is never delayed: heat is what hurts p99.

        Example (throttle 78, step 2, capacity 16, min 4, hysteresis 3): 84 °C → 13; cooling,
        82 → 13, 80 → 14, 77 → 15, 75 → 15, 74.9 → 16.
    """

    adaptive: bool = Field(default=True, description="False: always serve at maxBatchSize.")
    min_batch_size: Batch = DEFAULT_MIN_BATCH_SIZE
    throttle_celsius: float = 78.0
    critical_celsius: float = 90.0
    celsius_per_step: float = Field(default=2.0, gt=0)
    hysteresis_celsius: float = Field(default=3.0, ge=0)
    critical_for_seconds: float = Field(default=60.0, ge=0)

    @_model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.critical_celsius <= self.throttle_celsius:
            raise ValueError("criticalCelsius must be greater than throttleCelsius")
        return self

    @property
    def release_celsius(self) -> float:
        """Below this the full batch returns and a vacated node is released."""
        return self.throttle_celsius - self.hysteresis_celsius

    def limits(self, capacity: int) -> BatchLimits:
        """This policy for an engine of `capacity` sequences (its floor capped by it)."""
        return BatchLimits(self, capacity)

    def node_reason(self, temp: float | None) -> ThermalReason:
        """A node's reason (the node agent's): Normal only below throttle − hysteresis, the point
        where a replica gets its full batch back and a tainted node may take replicas again."""
        if temp is None:
            return REASON_NO_READING
        if temp >= self.critical_celsius:
            return REASON_CRITICAL
        return REASON_THROTTLED if temp >= self.release_celsius else REASON_NORMAL


DEFAULTS = ThermalPolicy()


class BatchLimits:
    """A policy applied to an engine's capacity: the arithmetic the governor runs. Pure."""

    def __init__(self, policy: ThermalPolicy, capacity: int) -> None:
        if not 1 <= capacity <= MAX_BATCH:
            raise ValueError(f"capacity must be within 1..{MAX_BATCH}, got {capacity}")
        self.policy = policy
        self.max_batch_size = capacity
        self.min_batch_size = min(policy.min_batch_size, capacity)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchLimits) and (self.policy, self.max_batch_size) == (
            other.policy,
            other.max_batch_size,
        )

    def __hash__(self) -> int:
        return hash((self.policy, self.max_batch_size))

    def _clamp(self, value: int) -> int:
        return max(self.min_batch_size, min(self.max_batch_size, value))

    def batch_for(self, temp: float) -> int:
        """The memoryless formula (no hysteresis)."""
        p = self.policy
        if temp < p.throttle_celsius:
            return self.max_batch_size
        if temp >= p.critical_celsius:
            return self.min_batch_size
        steps = math.floor((temp - p.throttle_celsius) / p.celsius_per_step)
        return self._clamp(self.max_batch_size - steps)

    def next_batch(self, temp: float | None, current: int | None) -> int:
        """The batch limit a replica at `temp` °C, now allowed `current`, should be allowed."""
        if not self.policy.adaptive or temp is None or math.isnan(temp):
            return self.max_batch_size  # no policy or no sensor: serve at full size
        target = self.batch_for(temp)
        if current is None:
            return target
        current = self._clamp(current)
        if target <= current:
            return target  # hotter (or unchanged): shrink at once
        if temp < self.policy.release_celsius:
            return self.max_batch_size
        # Cooling inside the band: grow only as far as a reading `hysteresis` hotter allows,
        # and never to the full batch (that needs T < throttle − hysteresis).
        hotter = temp + self.policy.hysteresis_celsius
        cautious = min(self.batch_for(hotter), self.max_batch_size - 1)
        return self._clamp(max(current, cautious))

    def shedding(self, temp: float | None, was: bool) -> bool:
        """The ladder's second step, with hysteresis: from `critical` down to `critical −
        hysteresis` the replica keeps asking for its new work to go to cooler peers."""
        if not self.policy.adaptive or temp is None or math.isnan(temp):
            return False
        if temp >= self.policy.critical_celsius:
            return True
        return was and temp >= self.policy.critical_celsius - self.policy.hysteresis_celsius

    def reason(self, temp: float | None, batch: int, shedding: bool = False) -> ThermalReason:
        """The condition reason for a replica at `temp` running `batch` (Critical: shedding)."""
        if not self.policy.adaptive:
            return REASON_POLICY_OFF
        if temp is None:
            return REASON_NO_READING
        if shedding or temp >= self.policy.critical_celsius:
            return REASON_CRITICAL
        return REASON_THROTTLED if batch < self.max_batch_size else REASON_NORMAL


# ----------------------------------------------------------------------------- the report
# A report's temperature range: wider than any device runs, narrower than a broken sensor's
# garbage (sysfs has been seen to say 6553 °C), which is reported as the bound it passes.
MIN_CELSIUS, MAX_CELSIUS = -273, 1000


def whole_degrees(temp: float | None) -> int | None:
    """A sensor's reading as a report carries it: whole degrees within the report's range."""
    if temp is None or math.isnan(temp):
        return None
    return max(MIN_CELSIUS, min(MAX_CELSIUS, round(temp)))


# Joules per output token as a report carries it: two significant digits (0.42, 1.3, 17), so
# the noise in the last digits is never a change; `reporter` adds a band and a rate.
JOULES_DIGITS = 2
MAX_JOULES_PER_TOKEN = 1e6
JoulesPerToken = Annotated[float, Field(ge=0, le=MAX_JOULES_PER_TOKEN, allow_inf_nan=False)]


def report_joules(value: float | None) -> float | None:
    """A J/token figure as a report carries it (two significant digits); None for no figure."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    if value == 0:
        return 0.0
    digits = JOULES_DIGITS - 1 - math.floor(math.log10(value))
    return min(MAX_JOULES_PER_TOKEN, float(round(value, digits)))


@dataclass(
    frozen=True,
    config=ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True),
)
class ThermalReading:
    """What one `ember.dev/Thermal` condition says, typed (whole degrees)."""

    reason: ThermalReason
    temperature_celsius: Annotated[int, Field(ge=MIN_CELSIUS, le=MAX_CELSIUS)] | None
    max_batch_size: Batch | None = None  # the limit in force (None on a node's condition)
    capacity: Batch | None = None  # the engine's own maximum (ditto)
    detail: str | None = None  # why a configured sensor gives no reading, if one does not
    # Energy per output token over the replica's last minute (a pod's, when a power sensor
    # reads and tokens were generated; `report_joules` precision).
    joules_per_token: JoulesPerToken | None = None

    @field_validator("detail")
    @classmethod
    def _short(cls, value: str | None) -> str | None:
        return value[:MAX_DETAIL] if value else None

    @_model_validator(mode="after")
    def _batch_within_capacity(self) -> Self:
        if (self.max_batch_size is None) != (self.capacity is None):
            raise ValueError("maxBatchSize and capacity come together (a pod's) or not at all")
        if self.max_batch_size is not None and self.max_batch_size > (self.capacity or 0):
            raise ValueError(f"maxBatchSize {self.max_batch_size} > capacity {self.capacity}")
        return self

    @property
    def limited(self) -> bool:
        return self.reason in LIMITED_REASONS

    @property
    def reduced(self) -> bool:
        """Whether the governor runs this replica below its engine's capacity."""
        return self.max_batch_size is not None and self.max_batch_size < (self.capacity or 0)

    def message(self) -> str:
        """The human line: `84 °C, batch 13/16` (a pod), `84 °C` (a node), `no reading, …`,
        then `, 0.42 J/token` when the pod has that figure, a sensor problem after `; `."""
        temp = self.temperature_celsius
        head = "no reading" if temp is None else f"{temp} °C"
        if self.max_batch_size is not None:
            head = f"{head}, batch {self.max_batch_size}/{self.capacity}"
        if self.joules_per_token is not None:
            head = f"{head}, {self.joules_per_token:g} J/token"
        if self.detail:
            head = f"{head}; {self.detail}"
        return head


_READING = TypeAdapter(ThermalReading)


class ThermalReportError(ValueError):
    """A condition message that is not a report `thermal_condition` wrote."""


def encode_report(reading: ThermalReading) -> str:
    """The condition's message: the human line, then the same values as one line of JSON."""
    # Every key, null or not; except joulesPerToken, present only with a figure: a report
    # without one stays exactly what a decoder older than the field takes.
    skip = None if reading.joules_per_token is not None else {"joules_per_token"}
    data = _READING.dump_json(reading, by_alias=True, exclude=skip).decode()
    return f"{reading.message()}\n{REPORT_PREFIX}{data}"


def decode_report(message: str) -> ThermalReading:
    """The reading `encode_report` wrote into `message`; ThermalReportError for anything else
    (a human-only line, broken JSON, an unknown reason or field, a batch above its capacity)."""
    _, newline, last = message.rpartition("\n")
    if not newline or not last.startswith(REPORT_PREFIX):
        raise ThermalReportError(f"no {REPORT_PREFIX.strip()} line in the message")
    try:
        return _READING.validate_json(last.removeprefix(REPORT_PREFIX), strict=True, by_alias=True)
    except ValidationError as exc:
        raise ThermalReportError(f"malformed thermal report: {_first_error(exc)}") from exc


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err['msg']}" if where else str(err["msg"])


def thermal_condition(reading: ThermalReading, now: str) -> dict[str, Any]:
    """The condition as written (lastTransitionTime set by the writer; the kubelet keeps it)."""
    return {
        "type": THERMAL_CONDITION,
        "status": _status(reading),
        "reason": reading.reason,
        "message": encode_report(reading),
        "lastTransitionTime": now,
    }


def _status(reading: ThermalReading) -> str:
    return "True" if reading.limited else "False"


def read_thermal_condition(condition: dict[str, Any]) -> ThermalReading:
    """One `ember.dev/Thermal` condition, decoded and checked against its own reason and status
    (a writer that says Normal in one place and Critical in the other is refused)."""
    reading = decode_report(str(condition.get("message") or ""))
    if condition.get("reason") != reading.reason:
        raise ThermalReportError(
            f"reason {condition.get('reason')!r} disagrees with the report's {reading.reason!r}"
        )
    if condition.get("status") != _status(reading):
        raise ThermalReportError(f"status {condition.get('status')!r} disagrees with the report")
    return reading


def parse_thermal_condition(conditions: list[dict[str, Any]] | None) -> ThermalReading | None:
    """The `ember.dev/Thermal` condition among a Pod's or Node's conditions, typed; None if absent
    or not a report `thermal_condition` wrote (the writer is a tenant's pod: never trusted)."""
    cond = next((c for c in conditions or [] if c.get("type") == THERMAL_CONDITION), None)
    if cond is None:
        return None
    try:
        return read_thermal_condition(cond)
    except ThermalReportError:
        return None
