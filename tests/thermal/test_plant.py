"""The thermal plant (tests/thermal/plant.py): it heats with work, cools without it, throttles
and trips at its thresholds, and its sensor files are what the runtime's real readers read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ember_runtime.sensors.thermal_zone import ThermalZoneReader

from bench.gateway_overhead import cpu_seconds
from tests.support.waiting import wait_for
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.plant import (
    PROFILES,
    Device,
    Plant,
    PlantState,
    Profile,
    step,
)

BOX = Profile(
    name="test",
    idle_watts=2.0,
    max_watts=20.0,
    resistance=3.0,  # full load settles at 25 + 60 = 85 °C
    capacitance=100.0,  # τ = 300 s
    throttle_celsius=70.0,
    trip_celsius=95.0,
    reset_seconds=30.0,
)


def run(profile: Profile, state: PlantState, util: float, seconds: float) -> list[str]:
    events: list[str] = []
    for _ in range(int(seconds)):
        events += step(profile, state, util, 1.0, profile.ambient_celsius)
    return events


def test_it_heats_with_work_towards_its_steady_state() -> None:
    busy, idle = PlantState(celsius=25.0), PlantState(celsius=25.0)
    no_throttle = Profile(**{**BOX.__dict__, "throttle_celsius": 200.0, "trip_celsius": 300.0})
    run(no_throttle, busy, 1.0, 3 * BOX.tau)
    run(no_throttle, idle, 0.0, 3 * BOX.tau)
    assert busy.celsius == pytest.approx(25 + 0.95 * 60, abs=1.0)  # 1 − e⁻³ of the way
    assert idle.celsius == pytest.approx(25 + 0.95 * 6, abs=1.0)
    assert busy.joules == pytest.approx(20.0 * 3 * BOX.tau)


def test_one_time_constant_is_63_percent_of_the_way() -> None:
    state = PlantState(celsius=25.0)
    no_throttle = Profile(**{**BOX.__dict__, "throttle_celsius": 200.0, "trip_celsius": 300.0})
    step(no_throttle, state, 1.0, BOX.tau, 25.0)  # one big step: the exact solution
    assert state.celsius == pytest.approx(25 + 0.632 * 60, abs=0.2)


def test_it_cools_without_work() -> None:
    state = PlantState(celsius=85.0)
    run(BOX, state, 0.0, 5 * BOX.tau)
    assert state.celsius == pytest.approx(BOX.steady(0.0), abs=0.5)


def test_it_throttles_at_its_threshold_and_releases_below_the_hysteresis() -> None:
    state = PlantState(celsius=25.0)
    events = run(BOX, state, 1.0, 3 * BOX.tau)
    assert "throttle" in events and state.throttled
    assert state.celsius >= BOX.throttle_celsius
    events = run(BOX, state, 0.0, 60)
    assert state.throttled or state.celsius < BOX.throttle_celsius - BOX.hysteresis_celsius
    events = run(BOX, state, 0.0, 3 * BOX.tau)
    assert "release" in events and not state.throttled
    assert state.throttled_seconds > 0


def test_it_trips_resets_and_draws_nothing_while_down() -> None:
    hot = Profile(**{**BOX.__dict__, "ambient_celsius": 45.0})  # full load would reach 105 °C
    state = PlantState(celsius=45.0)
    events: list[str] = []
    for _ in range(int(3 * BOX.tau)):
        events += step(hot, state, 1.0, 1.0, 45.0)
        if "trip" in events:
            break
    assert "trip" in events and state.trips == 1 and state.down_until is not None
    after = run(hot, state, 1.0, hot.reset_seconds - 1)  # work offered, none done: it is down
    assert state.watts == 0.0 and after == []
    back = run(hot, state, 1.0, 2)
    assert back[0] == "reset-done" and state.down_until is None


def test_the_profiles_throttle_before_they_trip_and_trip_only_when_enclosed() -> None:
    for profile in PROFILES.values():
        assert profile.idle_watts < profile.max_watts
        assert profile.throttle_celsius < profile.trip_celsius
        assert profile.steady(0.0) < profile.throttle_celsius, profile.name  # idle is fine


def test_the_runtime_sensor_reads_what_the_plant_writes(tmp_path: Path) -> None:
    work = [0.0]
    tree = FakeThermalTree(tmp_path / "sys")
    plant = Plant(BOX, Device(cpus=1.0, work=lambda: work[0]), tree, speed=100.0, period=0.02)
    plant.start()

    def hot_or_busier() -> bool:
        if plant.state.celsius >= 40:
            return True
        work[0] += 0.02  # one busy core: 0.02 s of work each 0.02 s
        return False

    try:
        wait_for("a busy device to heat past 40 °C", hot_or_busier, 5, 0.02)
    finally:
        plant.stop()
    reading = ThermalZoneReader(tree.root).read()
    assert reading["cpu-thermal"] == pytest.approx(plant.state.celsius, abs=0.01)
    assert plant.state.celsius >= 40, "a busy device must heat"
    energy = int((tree.root / "class/powercap/intel-rapl:0/energy_uj").read_text())
    assert energy == pytest.approx(plant.state.joules * 1e6, rel=1e-3)


def test_trip_kills_and_reset_restarts(tmp_path: Path) -> None:
    calls: list[str] = []
    hot = Profile(**{**BOX.__dict__, "ambient_celsius": 94.0, "reset_seconds": 5.0})
    device = Device(
        cpus=1.0,
        work=time.monotonic,  # always busy
        throttle=lambda f: calls.append(f"throttle {f}"),
        kill=lambda: calls.append("kill"),
        on_reset=lambda: calls.append("reset"),
    )
    plant = Plant(hot, device, FakeThermalTree(tmp_path / "sys"), speed=100.0, period=0.01)
    plant.start()
    try:
        wait_for("a trip and its reset", lambda: "reset" in calls, 5, 0.01)
    finally:
        plant.stop()
    assert "kill" in calls and "reset" in calls and calls.index("kill") < calls.index("reset")
    assert plant.state.trips >= 1


def test_cpu_seconds_counts_this_process() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.2
