"""The thermal policy as tables: formula, hysteresis, and node heat with an injected clock."""

from __future__ import annotations

import itertools

import pytest
from ember_operator.api.models import parse_spec
from ember_operator.thermal.policy import (
    NodeHeat,
    NodeVerdict,
    ThermalLimits,
    batch_for,
    max_batch,
)

ISSUE = ThermalLimits(max_batch=16, min_batch=4, throttle_celsius=78, celsius_per_step=2)


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
    off = ThermalLimits(adaptive=False)
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
    limits = ThermalLimits.from_spec(spec)
    assert (limits.max_batch, limits.min_batch, limits.critical_for_seconds) == (32, 8, 30.0)
    assert max_batch(80.0, limits, 32) == 30 and max_batch(200.0, limits, 32) == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_batch": 8, "max_batch": 4},
        {"min_batch": 0},
        {"celsius_per_step": 0},
        {"critical_celsius": 70, "throttle_celsius": 78},
        {"hysteresis_celsius": -1},
    ],
)
def test_bad_limits_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ThermalLimits(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- node heat

HEAT = ThermalLimits(critical_celsius=90, critical_for_seconds=60)


def test_critical_for_the_window_vacates_then_cooling_releases() -> None:
    heat = NodeHeat()
    assert heat.observe("n1", 85.0, HEAT, now=0) is NodeVerdict.OK
    assert heat.observe("n1", 90.0, HEAT, now=10) is NodeVerdict.WATCH
    assert heat.observe("n1", 95.0, HEAT, now=69.9) is NodeVerdict.WATCH
    assert heat.observe("n1", 91.0, HEAT, now=70) is NodeVerdict.VACATE
    heat.mark_tainted("n1", now=70)
    assert heat.observe("n1", 92.0, HEAT, now=71) is NodeVerdict.VACATE  # still there: again
    assert heat.observe("n1", 80.0, HEAT, now=80) is NodeVerdict.HOLD
    assert heat.observe("n1", 75.0, HEAT, now=90) is NodeVerdict.HOLD  # not below 78 − 3
    assert heat.observe("n1", 74.0, HEAT, now=95) is NodeVerdict.RELEASE
    heat.mark_released("n1")
    assert heat.observe("n1", 74.0, HEAT, now=96) is NodeVerdict.OK


def test_a_dip_below_critical_restarts_the_window() -> None:
    heat = NodeHeat()
    heat.observe("n1", 95.0, HEAT, now=0)
    assert heat.observe("n1", 89.9, HEAT, now=59) is NodeVerdict.OK
    assert heat.observe("n1", 95.0, HEAT, now=61) is NodeVerdict.WATCH
    assert heat.observe("n1", 95.0, HEAT, now=120) is NodeVerdict.WATCH
    assert heat.observe("n1", 95.0, HEAT, now=121) is NodeVerdict.VACATE


def test_nodes_are_independent_and_policy_off_never_vacates() -> None:
    heat = NodeHeat()
    heat.observe("hot", 99.0, HEAT, now=0)
    heat.observe("cool", 60.0, HEAT, now=0)
    assert heat.observe("hot", 99.0, HEAT, now=60) is NodeVerdict.VACATE
    assert heat.observe("cool", 60.0, HEAT, now=60) is NodeVerdict.OK
    off = ThermalLimits(adaptive=False)
    assert heat.observe("other", 120.0, off, now=0) is NodeVerdict.OK
    assert heat.observe("other", 120.0, off, now=1000) is NodeVerdict.OK


def test_tainted_nodes_without_readings_are_released_to_reprobe() -> None:
    heat = NodeHeat(probe_after_seconds=300)
    heat.adopt("n1", now=0)  # found tainted at operator start
    heat.mark_tainted("n2", now=100)
    assert heat.stale(now=299) == []
    assert heat.stale(now=300) == ["n1"]
    heat.observe("n1", 80.0, HEAT, now=350)  # a reading refreshes it
    assert heat.stale(now=400) == ["n2"]
