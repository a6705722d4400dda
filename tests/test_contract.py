"""The contract package (ember_runtime.contract): it stands alone, and the thermal report it
defines is data with one encoder and one decoder that refuses anything it did not write."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from ember_operator.api.crdgen import crd
from ember_operator.api.models import EngineSpec, ThermalSpec
from ember_runtime.contract.admin import AdminState, read_admin_state
from ember_runtime.contract.config import EngineConfig, RuntimeConfig, fetch_from_spec
from ember_runtime.contract.errors import ErrorBody, error_body
from ember_runtime.contract.resource import (
    DEFAULT_PORT,
    GROUP,
    PLURAL,
    SpecView,
    collection_path,
    read_spec,
)
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
from pydantic import BaseModel

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


# ----------------------------------------------------------------------------- formats (#46)


def test_admin_state_round_trips_and_reads_tolerantly() -> None:
    """The runtime's `/admin/state` body (camelCase) is what the gateway decodes; a field the
    gateway does not know is ignored, one it routes on may not be missing."""
    state = AdminState(max_batch_size=13, capacity=16, queue_depth=2, active_sequences=5)
    wire = state.model_dump_json(by_alias=True)
    assert '"maxBatchSize":13' in wire and '"activeSequences":5' in wire
    assert read_admin_state(wire.encode()) == state
    newer = {**json.loads(wire), "somethingNew": {"x": 1}}
    assert read_admin_state(json.dumps(newer).encode()) == state
    older = {"maxBatchSize": 4, "capacity": 4, "queueDepth": 0, "activeSequences": 1}
    assert read_admin_state(json.dumps(older).encode()).thermal_reason == ""
    with pytest.raises(ValueError, match="queueDepth"):
        read_admin_state(json.dumps({**older, "queueDepth": None}).encode())
    with pytest.raises(ValueError, match="capacity"):
        read_admin_state(json.dumps({k: v for k, v in older.items() if k != "capacity"}).encode())


def test_the_openai_error_body() -> None:
    detail = {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    assert error_body(429, "busy", code="queue_full") == {"error": detail}
    assert error_body(502, "x")["error"]["type"] == "server_error"
    assert error_body(422, "x", param="n")["error"]["type"] == "invalid_request_error"
    body = json.dumps(error_body(404, "no such model", param="model"))
    assert ErrorBody.model_validate_json(body).error.param == "model"


def _crd_spec() -> dict[str, Any]:
    version = crd()["spec"]["versions"][0]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models in a field's type (`X`, `X | None`, `list[X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def _missing(view: type[BaseModel], schema: dict[str, Any], where: str) -> list[str]:
    """The view's fields (by their camelCase names, recursively) the CRD's schema lacks."""
    out: list[str] = []
    for name, field in view.model_fields.items():
        alias = field.alias or name
        prop = (schema.get("properties") or {}).get(alias)
        if prop is None:
            out.append(f"{where}.{alias}")
            continue
        for model in _models(field.annotation):
            out += _missing(model, prop.get("items", prop), f"{where}.{alias}")
    return out


def test_the_spec_view_reads_only_what_the_crd_defines() -> None:
    """The node side's view of an InferenceDeployment names fields of the CRD the operator's
    models generate, with its defaults: a renamed field fails here, not in a gateway."""
    assert _missing(SpecView, _crd_spec(), "spec") == []
    assert _crd_spec()["properties"]["server"]["properties"]["port"]["default"] == DEFAULT_PORT
    assert (crd()["spec"]["group"], crd()["spec"]["names"]["plural"]) == (GROUP, PLURAL)
    assert collection_path("ns") == "/apis/ember.dev/v1alpha1/namespaces/ns/inferencedeployments"


def test_one_reading_of_spec_model() -> None:
    """The gateway's name and the node agent's fetch list come from the same parse; fields the
    view does not name are ignored, a shape the CRD refuses is a ValueError."""
    sha = "a" * 64
    model = {
        "name": "chat",
        "format": "gguf",
        "task": "generate",
        "source": {"http": {"urls": {"m.gguf": "https://o/m"}, "secretRef": {"name": "hf"}}},
        "files": [{"path": "m.gguf", "sha256": sha, "sizeBytes": 10}],
        "somethingNew": True,
    }
    spec = read_spec({"spec": {"model": model, "replicas": 2}})
    assert (spec.model.name, spec.server.port, spec.server.api_key_secret_ref) == (
        "chat",
        DEFAULT_PORT,
        None,
    )
    fetch = fetch_from_spec(model)
    assert fetch is not None and fetch.secret_ref == "hf"
    assert [(f.url, f.sha256, f.size_bytes) for f in fetch.files] == [("https://o/m", sha, 10)]
    assert fetch_from_spec({**model, "source": {"hostPath": {"path": "/m"}}}) is None
    for bad in ("not an object", {**model, "name": ""}, {**model, "files": [{"path": "m"}]}):
        with pytest.raises(ValueError):
            fetch_from_spec(bad)


def test_legacy_engine_args_still_work_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    default = EngineConfig().llamacpp_modes()
    assert (default.deterministic, default.prefix_cache, default.repack) == (False, None, None)
    assert EngineConfig(deterministic=True).llamacpp_modes().deterministic
    old = EngineConfig(args={"exactBatching": "true", "prefixCache": "false"})
    modes = old.llamacpp_modes()
    assert modes.deterministic and modes.prefix_cache is False and modes.repack is None
    assert "engine.args.exactBatching is deprecated" in caplog.text
    assert "engine.args.prefixCache is deprecated" in caplog.text
    fast = EngineConfig(args={"exactBatching": "false", "repack": "true"}).llamacpp_modes()
    assert not fast.deterministic and fast.repack
