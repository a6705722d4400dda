"""The contract package (ember_runtime.contract): it stands alone, and the thermal report it
defines is data with one encoder and one decoder that refuses anything it did not write."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ember_operator.api.models import EngineSpec, ThermalSpec
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.thermal import (
    DEFAULTS,
    REPORT_PREFIX,
    THERMAL_CONDITION,
    ThermalPolicy,
    ThermalReading,
    ThermalReportError,
    decode_report,
    encode_report,
    parse_thermal_condition,
    read_thermal_condition,
    report_joules,
    thermal_condition,
    whole_degrees,
)
from ember_runtime.thermal.governor import Governor

CONTRACT = Path(__file__).resolve().parent.parent / "runtime" / "ember_runtime" / "contract"
# What the contract may import from Ember: itself only (the sizing rule reads the contract's
# config, not the other way round).
ALLOWED = ("ember_runtime.contract",)


def _ember_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith(("ember_runtime", "ember_operator"))}


def test_the_contract_imports_neither_side() -> None:
    found = {p.name: _ember_imports(p) for p in CONTRACT.glob("*.py")}
    assert "thermal.py" in found and "config.py" in found
    stray = {f: sorted(m for m in mods if not m.startswith(ALLOWED)) for f, mods in found.items()}
    assert {f: m for f, m in stray.items() if m} == {}


READINGS = [
    ThermalReading("Throttled", 84, 13, 16),
    ThermalReading("Normal", 60, 16, 16),
    ThermalReading("Critical", 93),  # a node's: no batch
    ThermalReading("NoReading", None, 16, 16),
    ThermalReading("SensorUnavailable", None, 16, 16, "nvml: NVML cannot start\nsecond line"),
    ThermalReading("Normal", -5, 4, 4, f"odd {REPORT_PREFIX} text; 99 °C, batch 1/1"),
    ThermalReading("PolicyOff", 120, 256, 256),
    ThermalReading("Throttled", 84, 13, 16, "nvml: GPU is lost", joules_per_token=0.42),
]


@pytest.mark.parametrize("reading", READINGS, ids=lambda r: r.reason)
def test_round_trip(reading: ThermalReading) -> None:
    cond = thermal_condition(reading, "2026-01-01T00:00:00Z")
    assert cond["message"].startswith(reading.message())  # people read the sentence first
    assert decode_report(cond["message"]) == reading
    assert read_thermal_condition(cond) == reading
    assert parse_thermal_condition([{"type": "Ready", "status": "True"}, cond]) == reading


def test_the_data_line_is_json_with_every_field() -> None:
    message = encode_report(ThermalReading("Throttled", 84, 13, 16))
    human, data = message.split("\n")
    assert human == "84 °C, batch 13/16"
    assert data.startswith(REPORT_PREFIX)
    assert json.loads(data.removeprefix(REPORT_PREFIX)) == {
        "reason": "Throttled",
        "temperatureCelsius": 84,
        "maxBatchSize": 13,
        "capacity": 16,
        "detail": None,
    }


def test_joules_per_token_rides_in_both_lines_and_only_when_there_is_one() -> None:
    reading = ThermalReading("Normal", 60, 16, 16, joules_per_token=report_joules(0.4266))
    human, data = encode_report(reading).split("\n")
    assert human == "60 °C, batch 16/16, 0.43 J/token"
    assert json.loads(data.removeprefix(REPORT_PREFIX))["joulesPerToken"] == 0.43
    # Without a figure the data line is exactly the one a decoder older than the field takes.
    plain = encode_report(ThermalReading("Normal", 60, 16, 16))
    assert "joulesPerToken" not in plain and "J/token" not in plain


@pytest.mark.parametrize(
    ("value", "carried"),
    [
        (0.4266, 0.43),
        (0.004567, 0.0046),
        (12.7, 13.0),
        (1234.5, 1200.0),
        (0.0, 0.0),
        (None, None),
        (float("nan"), None),
        (float("inf"), None),
        (-1.0, None),
    ],
)
def test_report_joules_keeps_two_significant_digits(
    value: float | None, carried: float | None
) -> None:
    assert report_joules(value) == carried


GOOD = {"reason": "Throttled", "temperatureCelsius": 84, "maxBatchSize": 13, "capacity": 16}


def _line(data: Any) -> str:
    return f"84 °C, batch 13/16\n{REPORT_PREFIX}{json.dumps(data)}"


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ("84 °C, batch 13/16", "no ember.dev/thermal.v1 line"),  # the old sentence alone
        (f"{REPORT_PREFIX}{json.dumps(GOOD)}", "no ember.dev/thermal.v1 line"),  # no sentence
        (f"84 °C\n{REPORT_PREFIX}{{not json", "malformed"),
        (f"84 °C\nember.dev/thermal.v2 {json.dumps(GOOD)}", "no ember.dev/thermal.v1 line"),
        (_line({**GOOD, "reason": "Melting"}), "reason"),
        (_line({**GOOD, "maxBatchSize": 17}), "maxBatchSize 17 > capacity 16"),
        (_line({**GOOD, "capacity": None}), "come together"),
        (
            _line({**GOOD, "capacity": 100_000, "maxBatchSize": 100_000}),
            "less than or equal to 256",
        ),
        (_line({**GOOD, "temperatureCelsius": 10_000}), "less than or equal to 1000"),
        (_line({**GOOD, "temperatureCelsius": "84"}), "temperatureCelsius"),
        (_line({**GOOD, "evict": "everything"}), "evict"),
        (_line({**GOOD, "joulesPerToken": -0.5}), "joulesPerToken"),
        (_line({**GOOD, "joulesPerToken": "0.5"}), "joulesPerToken"),
        (_line({k: v for k, v in GOOD.items() if k != "reason"}), "reason"),
        (_line([GOOD]), "malformed"),
    ],
)
def test_a_malformed_report_is_refused(message: str, why: str) -> None:
    with pytest.raises(ThermalReportError, match=why):
        decode_report(message)
    cond = {"type": THERMAL_CONDITION, "status": "True", "reason": "Throttled", "message": message}
    assert parse_thermal_condition([cond]) is None  # the operator sees no report, not a crash


def test_a_report_that_contradicts_its_condition_is_refused() -> None:
    cond = thermal_condition(ThermalReading("Throttled", 84, 13, 16), "t")
    with pytest.raises(ThermalReportError, match="reason 'Normal' disagrees"):
        read_thermal_condition({**cond, "reason": "Normal"})
    with pytest.raises(ThermalReportError, match="status 'False' disagrees"):
        read_thermal_condition({**cond, "status": "False"})
    assert parse_thermal_condition([{**cond, "reason": "Critical"}]) is None


def test_a_long_sensor_problem_is_cut_on_both_sides() -> None:
    reading = ThermalReading("SensorUnavailable", None, 16, 16, "x" * 5000)
    assert reading.detail is not None and len(reading.detail) == 300
    data = {**GOOD, "reason": "SensorUnavailable", "detail": "y" * 5000}
    assert len(decode_report(_line(data)).detail or "") == 300


def test_a_broken_sensors_reading_still_makes_a_report() -> None:
    """The governor reports whatever a sensor says; a garbage value must not stop it."""
    assert [whole_degrees(t) for t in (84.4, 6553.5, -400.0, float("nan"), None)] == [
        84,
        1000,
        -273,
        None,
        None,
    ]
    gov = Governor(ThermalPolicy().limits(16), lambda _: None)
    assert gov.apply(6553.5).reading() == ThermalReading("Critical", 1000, 4, 16)


def test_one_set_of_thermal_defaults() -> None:
    """The CRD's defaults and the runtime's are the contract's (the chart's: tests/chart)."""
    spec, engine = ThermalSpec(), EngineSpec()
    assert (spec.throttle_celsius, spec.critical_celsius) == (78, 90)  # the documented ones
    assert (spec.throttle_celsius, spec.critical_celsius, spec.celsius_per_step) == (
        DEFAULTS.throttle_celsius,
        DEFAULTS.critical_celsius,
        DEFAULTS.celsius_per_step,
    )
    assert spec.critical_for_seconds == DEFAULTS.critical_for_seconds
    runtime = RuntimeConfig(model_name="m", model_dir="/m")
    assert (engine.max_batch_size, engine.min_batch_size) == (
        runtime.engine.max_batch_size,
        runtime.thermal.min_batch_size,
    )


def test_max_batch_size_is_rendered_once() -> None:
    """The ConfigMap's config.yaml names maxBatchSize once (engine:), and the policy's ceiling
    is that value: there is no second copy to reconcile."""
    config = RuntimeConfig.model_validate(
        {"modelName": "m", "modelDir": "/m", "engine": {"maxBatchSize": 8}}
    )
    text = config.to_yaml()
    assert text.count("maxBatchSize") == 1
    assert "maxBatchSize" in yaml.safe_load(text)["engine"]
    assert config.limits().max_batch_size == 8 == config.limits().next_batch(20.0, None)
