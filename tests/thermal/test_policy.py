"""The thermal policy (the shared contract in ember_runtime.contract.thermal) as tables: formula,
hysteresis, reasons, and the condition's message round trip."""

from __future__ import annotations

import itertools

import pytest
from ember_operator.api.models import parse_spec
from ember_operator.render import thermal_policy
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.thermal import (
    THERMAL_CONDITION,
    BatchLimits,
    ThermalPolicy,
    ThermalReading,
    parse_thermal_condition,
    thermal_condition,
)
from pydantic import ValidationError

# The issue's example: an engine of 16 sequences (engine.maxBatchSize, the policy's ceiling).
# Critical far above, so the table shows the batch step alone (the ladder's first step).
ISSUE = ThermalPolicy(
    min_batch_size=4, throttle_celsius=78, celsius_per_step=2, critical_celsius=110
).limits(16)


def batch_for(temp: float, policy: BatchLimits) -> int:
    return policy.batch_for(temp)


def max_batch(temp: float | None, policy: BatchLimits, current: int | None) -> int:
    return policy.next_batch(temp, current)


def test_at_critical_the_batch_is_at_its_floor() -> None:
    """The ladder: from critical on, the floor (and shedding), wherever the steps had got to."""
    ladder = ThermalPolicy(min_batch_size=4, throttle_celsius=78, critical_celsius=90).limits(16)
    assert [ladder.batch_for(t) for t in (89.9, 90.0, 95.0)] == [11, 4, 4]
    assert ladder.shedding(90.0, False) and not ladder.shedding(89.9, False)
    assert ladder.shedding(87.0, True) and not ladder.shedding(86.9, True)
    assert not ladder.shedding(None, True)


@pytest.mark.parametrize(
    ("temp", "expected"),
    [
        (20.0, 16),
        (77.9, 16),
        (78.0, 16),
        (79.9, 16),
        (80.0, 15),
        (81.9, 15),
        (82.0, 14),
        (84.0, 13),
        (85.9, 13),
        (86.0, 12),
        (90.0, 10),
        (100.0, 5),
        (101.9, 5),
        (102.0, 4),
        (109.9, 4),
        (130.0, 4),
    ],
)
def test_formula_table(temp: float, expected: int) -> None:
    assert batch_for(temp, ISSUE) == expected
    # From the full batch (heating), the policy is the formula: shrinking is never delayed.
    assert max_batch(temp, ISSUE, current=16) == expected


@pytest.mark.parametrize(
    ("temp", "current", "expected"),
    [
        (84.0, 16, 13),  # the issue's example
        (84.0, 13, 13),  # steady
        (86.0, 13, 12),  # hotter: shrink at once
        (82.0, 13, 13),  # cooler by one step: held (a 3 °C hotter reading would still say 13)
        (80.0, 13, 14),  # cooler by two steps: grows, cautiously
        (79.0, 14, 14),  # a 3 °C hotter reading (82) would say 14: held
        (77.0, 14, 15),
        (77.0, 15, 15),  # below throttle, inside the band: never the full batch yet
        (75.0, 15, 15),  # 75 is not below 75
        (74.9, 15, 16),  # below throttle − hysteresis: full batch
        (74.9, 4, 16),
        (60.0, 16, 16),
    ],
)
def test_hysteresis_table(temp: float, current: int, expected: int) -> None:
    assert max_batch(temp, ISSUE, current) == expected


def test_cool_down_walk_never_flaps() -> None:
    """Heat to 84 → 13; wobble ±1 °C around each point while cooling: no value repeats."""
    current, seen = 16, []
    for temp in [84, 83, 84, 82, 83, 81, 82, 80, 81, 79, 78, 77, 76, 75, 76, 75, 74, 75, 76]:
        current = max_batch(float(temp), ISSUE, current)
        seen.append(current)
    assert seen[0] == 13
    changes = [b for a, b in itertools.pairwise(seen) if a != b]
    assert changes == sorted(changes), f"batch went down while cooling: {seen}"
    assert seen[-1] == 16 and seen[seen.index(16) - 1] < 16
    assert seen.index(16) == 16  # first full batch at 74 °C, not before


@pytest.mark.parametrize(
    ("temp", "current", "expected"),
    [(None, 8, 16), (float("nan"), 8, 16), (84.0, 99, 13), (84.0, 1, 12), (84.0, None, 13)],
)
def test_unknown_inputs(temp: float | None, current: int | None, expected: int) -> None:
    assert max_batch(temp, ISSUE, current) == expected


def test_policy_off_is_always_full() -> None:
    off = ThermalPolicy(adaptive=False).limits(16)
    assert max_batch(120.0, off, 4) == 16


def test_limits_from_a_real_spec() -> None:
    spec = parse_spec(
        {
            "model": {
                "name": "m",
                "format": "gguf",
                "source": {"hostPath": {"path": "/models/m"}},
                "files": [{"path": "m.gguf", "sha256": "a" * 64, "sizeBytes": 1}],
            },
            "engine": {"kind": "llamacpp", "maxBatchSize": 32, "minBatchSize": 8},
            "thermal": {
                "throttleCelsius": 70,
                "criticalCelsius": 85,
                "celsiusPerStep": 5,
                "criticalForSeconds": 30,
            },
        }
    )
    limits = thermal_policy(spec).limits(spec.engine.max_batch_size)
    assert (limits.max_batch_size, limits.min_batch_size, limits.policy.critical_for_seconds) == (
        32,
        8,
        30.0,
    )
    assert max_batch(80.0, limits, 32) == 30 and max_batch(200.0, limits, 32) == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_batch_size": 0},
        {"celsius_per_step": 0},
        {"critical_celsius": 70, "throttle_celsius": 78},
        {"hysteresis_celsius": -1},
    ],
)
def test_bad_limits_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        ThermalPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_floor_above_the_engines_ceiling_is_capped_by_it() -> None:
    """The ceiling is the engine's capacity (the one rendered maxBatchSize); a policy's floor
    above it is capped, as the governor did when the policy carried a ceiling of its own."""
    config = RuntimeConfig.model_validate(
        {"modelName": "m", "modelDir": "/m", "engine": {"maxBatchSize": 2}}
    )
    assert config.thermal.min_batch_size == 4
    limits = config.limits()
    assert (limits.max_batch_size, limits.min_batch_size) == (2, 2)
    assert limits.batch_for(200.0) == 2 and limits.next_batch(200.0, 2) == 2
    with pytest.raises(ValueError, match="capacity"):
        ThermalPolicy().limits(0)


@pytest.mark.parametrize(
    ("temp", "batch", "reason", "status"),
    [
        (60.0, 16, "Normal", "False"),
        (84.0, 13, "Throttled", "True"),
        (111.0, 4, "Critical", "True"),
        (None, 16, "NoReading", "False"),
    ],
)
def test_reasons_and_condition_round_trip(
    temp: float | None, batch: int, reason: str, status: str
) -> None:
    assert ISSUE.reason(temp, batch) == reason
    reading = ThermalReading(reason, None if temp is None else round(temp), batch, 16)
    cond = thermal_condition(reading, "2026-01-01T00:00:00Z")
    assert cond["type"] == THERMAL_CONDITION and cond["status"] == status
    assert parse_thermal_condition([{"type": "Ready"}, cond]) == reading


def test_messages_are_the_documented_ones() -> None:
    assert ThermalReading("Throttled", 84, 13, 16).message() == "84 °C, batch 13/16"
    assert ThermalReading("Critical", 93).message() == "93 °C"  # a node's: no batch
    node = thermal_condition(ThermalReading("Critical", 93), "2026-01-01T00:00:00Z")
    assert node["message"].splitlines()[0] == "93 °C"  # what `kubectl describe` shows first
    assert parse_thermal_condition([node]) == ThermalReading("Critical", 93)
    assert parse_thermal_condition([{**node, "message": "garbage"}]) is None
    # The sentence alone is no report any more: the data line is what is read.
    assert parse_thermal_condition([{**node, "message": "93 °C"}]) is None
    assert parse_thermal_condition([]) is None


def test_a_sensor_problem_rides_in_the_message_and_round_trips() -> None:
    why = "nvml: NVML cannot start (no NVIDIA driver?): NVML Shared Library Not Found"
    reading = ThermalReading("SensorUnavailable", None, 16, 16, detail=why)
    assert reading.message() == f"no reading, batch 16/16; {why}"
    cond = thermal_condition(reading, "2026-01-01T00:00:00Z")
    assert (cond["status"], cond["reason"]) == ("False", "SensorUnavailable")
    assert parse_thermal_condition([cond]) == reading
    # A broken GPU sensor on a node whose CPU zones still read: a temperature and the cause.
    partial = ThermalReading("Normal", 61, 16, 16, detail=why)
    assert parse_thermal_condition([thermal_condition(partial, "t")]) == partial
    long = ThermalReading("SensorUnavailable", None, 16, 16, detail="x" * 1000)
    assert len(long.message()) < 350


def test_policy_off_reason() -> None:
    assert ThermalPolicy(adaptive=False).limits(16).reason(120.0, 16) == "PolicyOff"
