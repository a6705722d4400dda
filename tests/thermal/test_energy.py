"""Joules per output token: the power readers on fake sysfs trees and the real npu-smi tables,
NVML through the real pynvml module with its device calls replaced, the meter's arithmetic, the
sliding window, the metrics, the condition's write rule, and the real runtime process."""

from __future__ import annotations

import asyncio
import logging
import re
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.config import SensorConfig
from ember_runtime.contract.thermal import ThermalReading, decode_report
from ember_runtime.reporter import ConditionReporter, joules_moved
from ember_runtime.sensors import SensorUnavailableError, build_source, telemetry_of
from ember_runtime.sensors.npu_smi import NpuSmiReader, parse_npu_smi_power
from ember_runtime.sensors.nvml import NvmlReader
from ember_runtime.sensors.power import (
    EnergyMeter,
    EnergyMonitor,
    EnergySnapshot,
    HwmonPowerReader,
    JoulesPerTokenWindow,
    MeteredSource,
    PowerReading,
    RaplReader,
    accelerator_power,
    build_monitor,
    joules_between,
    primary,
)
from ember_runtime.server.metrics import Metrics
from prometheus_client import generate_latest

from tests.support.waiting import wait_for
from tests.thermal.conftest import API_KEY, FIXTURES, FakeThermalTree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rapl(root: Path, index: str, name: str, microjoules: int, wrap: int | None = None) -> Path:
    """`<root>/class/powercap/intel-rapl:<index>/` as the kernel (and the emulated device)
    lays it out."""
    zone = root / "class" / "powercap" / f"intel-rapl:{index}"
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "name").write_text(name + "\n")
    if wrap is not None:
        (zone / "max_energy_range_uj").write_text(f"{wrap}\n")
    set_energy(zone, microjoules)
    return zone


def set_energy(zone: Path, microjoules: int) -> None:
    tmp = zone / "energy_uj.tmp"
    tmp.write_text(f"{microjoules}\n")
    tmp.replace(zone / "energy_uj")


def hwmon(root: Path, index: int, name: str, files: dict[str, str]) -> Path:
    chip = root / "class" / "hwmon" / f"hwmon{index}"
    chip.mkdir(parents=True, exist_ok=True)
    (chip / "name").write_text(name + "\n")
    for file, text in files.items():
        (chip / file).write_text(text + "\n")
    return chip


# ----------------------------------------------------------------------------- RAPL


def test_rapl_reads_package_domains_only(tmp_path: Path) -> None:
    rapl(tmp_path, "0", "package-0", 5_000_000, wrap=262_143_328_850)
    rapl(tmp_path, "1", "package-1", 1_500_000)
    rapl(tmp_path, "0:0", "core", 3_000_000)  # inside package 0
    rapl(tmp_path, "2", "psys", 9_000_000)  # contains the packages
    assert RaplReader(tmp_path).read() == {
        "package-0": PowerReading(joules=5.0, wrap_joules=262_143.32885),
        "package-1": PowerReading(joules=1.5),
    }


def test_rapl_absent_or_unreadable_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SensorUnavailableError, match="does not exist"):
        RaplReader(tmp_path).read()
    zone = rapl(tmp_path, "0", "package-0", 1)
    (zone / "energy_uj").unlink()  # what a non-root reader meets since Linux 5.10 (mode 0400)
    with pytest.raises(SensorUnavailableError, match="no readable package energy_uj"):
        RaplReader(tmp_path).read()


def test_rapl_wraparound_through_the_meter(tmp_path: Path) -> None:
    wrap = 1_000_000_000  # 1000 J
    zone = rapl(tmp_path, "0", "package-0", 999_000_000, wrap=wrap)
    reader, meter = RaplReader(tmp_path), EnergyMeter()
    assert meter.update(0.0, {"rapl": reader.read()}) == {}  # the first reading counts from here
    set_energy(zone, 4_000_000)  # 999 J → 1000 J → 0 → 4 J: 5 J used
    assert meter.update(1.0, {"rapl": reader.read()}) == {"rapl": pytest.approx(5.0)}
    assert meter.watts == {"rapl": pytest.approx(5.0)}
    set_energy(zone, 6_000_000)
    meter.update(2.0, {"rapl": reader.read()})
    assert meter.joules == {"rapl": pytest.approx(7.0)}


# ----------------------------------------------------------------------------- hwmon


JETSON_XAVIER = {  # ina3221: bus mV and mA per channel, rail names from the device tree
    "in1_label": "VDD_IN",
    "in1_input": "5000",
    "curr1_input": "2000",
    "in2_label": "VDD_CPU_GPU_CV",
    "in2_input": "5000",
    "curr2_input": "800",
    "in3_label": "VDD_SOC",
    "in3_input": "5000",
    "curr3_input": "400",
}


def test_hwmon_takes_the_input_rail_as_the_total(tmp_path: Path) -> None:
    hwmon(tmp_path, 0, "ina3221", JETSON_XAVIER)
    hwmon(tmp_path, 1, "nvme", {"power1_input": "3000000"})  # not a board monitor: ignored
    assert HwmonPowerReader(tmp_path).read() == {"hwmon0/VDD_IN": PowerReading(watts=10.0)}


def test_hwmon_without_an_input_rail_sums_the_connected_rails(tmp_path: Path) -> None:
    # AGX Orin: two ina3221, no VDD_IN; unconnected channels are labelled NC; one disabled.
    hwmon(
        tmp_path,
        0,
        "ina3221",
        {
            **{f"in{i}_label": r for i, r in enumerate(("VDD_GPU_SOC", "VDD_CPU_CV", "NC"), 1)},
            **{f"in{i}_input": "5000" for i in (1, 2, 3)},
            **{f"curr{i}_input": "1000" for i in (1, 2, 3)},
        },
    )
    hwmon(
        tmp_path,
        1,
        "ina3221",
        {
            "in1_label": "VIN_SYS_5V0",
            "in1_input": "5000",
            "curr1_input": "600",
            "in2_label": "VDDQ_VDD2_1V8AO",
            "in2_input": "5000",
            "curr2_input": "200",
            "in2_enable": "0",
        },
    )
    readings = HwmonPowerReader(tmp_path).read()
    assert readings == {
        "hwmon0/VDD_GPU_SOC": PowerReading(watts=5.0),
        "hwmon0/VDD_CPU_CV": PowerReading(watts=5.0),
        "hwmon1/VIN_SYS_5V0": PowerReading(watts=3.0),
    }


def test_hwmon_power_input_wins_over_volts_times_amps(tmp_path: Path) -> None:
    hwmon(
        tmp_path,
        0,
        "ina226",
        {"power1_input": "7500000", "in1_input": "12000", "curr1_input": "1"},  # µW; mV, mA
    )
    assert HwmonPowerReader(tmp_path).read() == {"hwmon0/power1": PowerReading(watts=7.5)}
    with pytest.raises(SensorUnavailableError, match="no power rail"):
        HwmonPowerReader(tmp_path, chips=("ina3221",)).read()
    with pytest.raises(SensorUnavailableError, match="does not exist"):
        HwmonPowerReader(tmp_path / "elsewhere").read()


# ----------------------------------------------------------------------------- NVML, npu-smi


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, energy: Any) -> None:
    """The real pynvml module with its device calls replaced: two GPUs."""
    pynvml = pytest.importorskip("pynvml")
    for call, fake in {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: "NVIDIA H100",
        "nvmlDeviceGetTemperature": lambda h, kind: 50,
        "nvmlDeviceGetClockInfo": lambda h, kind: 1980,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0,
        "nvmlDeviceGetPowerUsage": lambda h: 300_000 + 1000 * h,  # mW
        "nvmlDeviceGetTotalEnergyConsumption": energy,
    }.items():
        monkeypatch.setattr(pynvml, call, fake)


def test_nvml_energy_counter_reaches_the_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, lambda h: 1_000_000 + 500 * h)  # mJ
    reader = NvmlReader()
    assert reader.read() == {"gpu0": 50.0, "gpu1": 50.0}
    assert reader.telemetry()["gpu1"] == {
        "sm_clock_mhz": 1980.0,
        "power_watts": 301.0,
        "energy_joules": 1000.5,
    }
    readings = accelerator_power(reader.telemetry())
    assert readings == {
        "nvml": {
            "gpu0": PowerReading(joules=1000.0, watts=300.0),
            "gpu1": PowerReading(joules=1000.5, watts=301.0),
        }
    }


def test_nvml_without_an_energy_counter_keeps_power(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")

    def not_supported(_h: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # pre-Volta

    _fake_gpus(monkeypatch, not_supported)
    source = build_source(SensorConfig(nvml=True, zone_types=["none"]))
    assert source.read() == {"gpu0": 50.0, "gpu1": 50.0}  # the temperature is kept
    assert accelerator_power(telemetry_of(source))["nvml"]["gpu0"] == PowerReading(watts=300.0)


def test_npu_smi_power_from_the_same_table() -> None:
    text = (FIXTURES / "npu_smi_910b_8.txt").read_text()
    power = parse_npu_smi_power(text)
    assert len(power) == 8 and power["npu0/chip0"] == 70.0 and power["npu7/chip0"] == 65.6
    # A 310P3 that says NA for its power: no entry, its temperature still counts elsewhere.
    assert parse_npu_smi_power((FIXTURES / "npu_smi_310p3.txt").read_text()) == {}
    assert parse_npu_smi_power((FIXTURES / "npu_smi_310p3_x2.txt").read_text()) == {
        "npu0/chip0": 15.8,
        "npu1/chip0": 15.4,
    }
    assert parse_npu_smi_power("dcmi module initialize failed\n") == {}


def test_npu_smi_reader_hands_power_on_without_a_second_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    script = tmp_path / "npu-smi"
    table = FIXTURES / "npu_smi_310p3_x2.txt"
    script.write_text(
        f"#!{sys.executable}\nimport pathlib\n"
        f"p = pathlib.Path({str(runs)!r})\n"
        "p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
        f"print(open({str(table)!r}).read())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    reader = NpuSmiReader([str(script), "info"])
    assert reader.telemetry() == {}
    assert reader.read() == {"npu0/chip0": 42.0, "npu1/chip0": 43.0}
    assert accelerator_power(reader.telemetry()) == {
        "npu-smi": {"npu0/chip0": PowerReading(watts=15.8), "npu1/chip0": PowerReading(watts=15.4)}
    }
    assert runs.read_text() == "x"  # one run gave the temperatures and the power


# ----------------------------------------------------------------------------- arithmetic


def test_joules_between_counters_and_powers() -> None:
    assert joules_between(1.0, PowerReading(joules=10.0), PowerReading(joules=12.5)) == 2.5
    wrapped = PowerReading(joules=1.0, wrap_joules=100.0)
    assert joules_between(1.0, PowerReading(joules=99.0), wrapped) == pytest.approx(2.0)
    # Back without a range (a driver reload): that interval is lost, never negative.
    assert joules_between(1.0, PowerReading(joules=50.0), PowerReading(joules=3.0)) == 0.0
    # Powers: the trapezoid over the interval.
    assert joules_between(0.5, PowerReading(watts=10.0), PowerReading(watts=14.0)) == 6.0
    # A counter beats a power when both are there (NVML gives both).
    both = joules_between(2.0, PowerReading(5.0, None, 100.0), PowerReading(6.0, None, 100.0))
    assert both == 1.0
    assert joules_between(1.0, PowerReading(joules=1.0), PowerReading(watts=5.0)) == 0.0


def test_meter_integrates_each_source_and_forgets_gone_domains() -> None:
    meter = EnergyMeter()
    assert meter.update(0.0, {"hwmon": {"VDD_IN": PowerReading(watts=10.0)}}) == {}
    used = meter.update(
        0.25,
        {
            "hwmon": {"VDD_IN": PowerReading(watts=12.0)},
            "rapl": {"package-0": PowerReading(joules=100.0)},  # new: counts from the next
        },
    )
    assert used == {"hwmon": pytest.approx(2.75)}
    used = meter.update(0.5, {"rapl": {"package-0": PowerReading(joules=101.0)}})
    assert used == {"rapl": pytest.approx(1.0)}
    assert meter.watts == {"rapl": pytest.approx(4.0)}
    assert meter.joules == {"hwmon": pytest.approx(2.75), "rapl": pytest.approx(1.0)}
    meter.update(0.75, {"hwmon": {"VDD_IN": PowerReading(watts=12.0)}})  # hwmon came back
    assert meter.joules["hwmon"] == pytest.approx(2.75)  # nothing across its gap


def test_primary_source_order() -> None:
    assert primary(["rapl", "hwmon"]) == "hwmon"
    assert primary(["rapl", "nvml"]) == "nvml"
    assert primary(["npu-smi", "rapl"]) == "npu-smi"
    assert primary(["something"]) is None and primary([]) is None


def test_window_is_delta_joules_over_delta_tokens() -> None:
    window = JoulesPerTokenWindow(60.0)
    assert window.value() is None
    window.add(0.0, 0.0, 0.0)
    window.add(10.0, 100.0, 0.0)
    assert window.value() is None  # energy but no tokens: no figure, not infinity
    window.add(20.0, 200.0, 400.0)
    assert window.value() == 0.5
    window.add(70.0, 700.0, 400.0)  # 0 … 70 s: the 10 s sample is the window's start now
    assert window.value() == pytest.approx(600.0 / 400.0)
    window.add(140.0, 1400.0, 400.0)  # a minute without tokens: no figure
    assert window.value() is None
    with pytest.raises(ValueError):
        JoulesPerTokenWindow(0)


class FakePower:
    def __init__(self, name: str, reading: PowerReading | None) -> None:
        self.name, self.reading = name, reading

    def read(self) -> dict[str, PowerReading]:
        if self.reading is None:
            raise SensorUnavailableError(f"no {self.name} here")
        return {"d": self.reading}


def test_monitor_joules_per_token_and_source_switch() -> None:
    clock, tokens = Clock(), [0.0]
    rapl_power = FakePower("rapl", PowerReading(joules=0.0))
    monitor = EnergyMonitor([rapl_power], lambda: tokens[0], clock=clock)
    for t in range(1, 5):  # 10 W, 20 tokens/s
        clock.now = float(t)
        rapl_power.reading = PowerReading(joules=10.0 * t)
        tokens[0] = 20.0 * t
        monitor.sample()
    snap = monitor.snapshot()
    assert snap.source == "rapl" and snap.joules_per_token == pytest.approx(0.5)
    assert snap.joules == {"rapl": pytest.approx(30.0)} and snap.watts["rapl"] == 10.0
    # NVML comes up (the driver was late): the figure comes from it, over a fresh window.
    clock.now = 5.0
    monitor.sample({"gpu0": {"power_watts": 100.0}})
    clock.now = 6.0
    tokens[0] += 50
    monitor.sample({"gpu0": {"power_watts": 100.0}})
    assert monitor.snapshot().source == "nvml"
    assert monitor.joules_per_token() is None  # one sample of the new source: no window yet
    clock.now = 7.0
    tokens[0] += 50
    monitor.sample({"gpu0": {"power_watts": 100.0}})
    assert monitor.joules_per_token() == pytest.approx(2.0)  # 100 J / 50 tokens


def test_monitor_without_a_source_has_no_figure_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = [0.0]
    monitor = EnergyMonitor(
        [FakePower("rapl", None), FakePower("hwmon", None)], lambda: tokens[0], clock=Clock()
    )
    with caplog.at_level(logging.INFO, logger="ember_runtime.sensors.power"):
        for _ in range(10):
            tokens[0] += 10
            monitor.sample()
    snap = monitor.snapshot()
    assert snap == EnergySnapshot(joules={}, watts={}, source=None, joules_per_token=None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["no energy from hwmon: no hwmon here; rapl: no rapl here"]


def test_metered_source_samples_with_each_read_and_never_fails_it(tmp_path: Path) -> None:
    zone = rapl(tmp_path, "0", "package-0", 0)
    monitor = build_monitor(tmp_path, lambda: 0.0)

    class Temps:
        fail = False

        def read(self) -> dict[str, float]:
            if self.fail:
                raise SensorUnavailableError("zones gone")
            return {"soc": 50.0}

    temps = Temps()
    source = MeteredSource(temps, monitor)
    assert source.read() == {"soc": 50.0}
    set_energy(zone, 3_000_000)
    temps.fail = True
    with pytest.raises(SensorUnavailableError):
        source.read()  # the temperature's failure is the sampler's to handle, as before
    assert monitor.snapshot().joules == {"rapl": pytest.approx(3.0)}  # energy was still read

    def broken() -> float:
        raise RuntimeError("bug")

    temps.fail = False
    assert MeteredSource(temps, EnergyMonitor([], broken)).read() == {"soc": 50.0}


# ----------------------------------------------------------------------------- metrics


def test_metrics_export_energy_power_and_joules_per_token() -> None:
    metrics = Metrics()
    snap = EnergySnapshot({"rapl": 12.5}, {"rapl": 8.0}, "rapl", None)
    metrics.bind_energy(lambda: snap)
    text = generate_latest(metrics.registry).decode()
    assert 'ember_energy_joules_total{source="rapl"} 12.5' in text
    assert 'ember_power_watts{source="rapl"} 8.0' in text
    assert "ember_joules_per_output_token" not in text  # no tokens: absent, not 0
    snap = EnergySnapshot({"rapl": 12.5}, {"rapl": 8.0}, "rapl", 0.42)
    text = generate_latest(metrics.registry).decode()
    assert 'ember_joules_per_output_token{source="rapl"} 0.42' in text
    metrics.generated_tokens.inc(7)
    assert metrics.output_tokens() == 7.0


# ----------------------------------------------------------------------------- the condition


@pytest.mark.parametrize(
    ("last", "new", "moved"),
    [
        (None, None, False),
        (None, 0.42, True),  # appeared
        (0.42, None, True),  # went away (no tokens for a minute)
        (0.42, 0.44, False),  # within 10 %
        (0.42, 0.47, True),
        (0.42, 0.37, True),
        (0.0, 0.0, False),
    ],
)
def test_joules_moved(last: float | None, new: float | None, moved: bool) -> None:
    assert joules_moved(last, new) is moved


class Recorder:
    def __init__(self) -> None:
        self.conditions: list[dict[str, Any]] = []

    async def write(self, condition: dict[str, Any]) -> None:
        self.conditions.append(condition)


async def test_joules_alone_writes_at_most_once_a_minute_and_rides_on_other_writes() -> None:
    clock, rec = Clock(), Recorder()
    rep = ConditionReporter(rec, band_celsius=2.0, min_interval=0.0, clock=clock)
    task = asyncio.create_task(rep.run())

    async def offer(temp: int, joules: float | None) -> None:
        rep.offer(ThermalReading("Normal", temp, 16, 16, joules_per_token=joules))
        await asyncio.sleep(0.02)

    try:
        await offer(60, None)  # the first report
        for step in range(1, 60):  # a minute of samples with a moving figure: no write
            clock.now = float(step)
            await offer(60, 0.4 + step / 100)
        await offer(63, 0.8)  # the temperature moved: written, with the newest figure
        clock.now = 100.0
        await offer(63, 0.82)  # 60 s later but within the band: nothing
        clock.now = 125.0
        await offer(63, 1.0)  # 65 s after the last write and 25 % away: written
        clock.now = 126.0
        await offer(63, 1.5)  # moved again, but the last write is 1 s old
    finally:
        task.cancel()
    written = [decode_report(c["message"]).joules_per_token for c in rec.conditions]
    assert written == [None, 0.8, 1.0]
    assert rec.conditions[1]["message"].startswith("63 °C, batch 16/16, 0.8 J/token\n")


def test_each_governor_report_carries_the_figure() -> None:
    from ember_runtime.server.app import _on_reading
    from ember_runtime.server.health import HealthTracker

    rep = ConditionReporter(Recorder(), band_celsius=2.0)
    figure: list[float | None] = [0.4266]
    on_reading = _on_reading(HealthTracker(60), rep, lambda: figure[0])
    on_reading(ThermalReading("Normal", 60, 16, 16))
    assert rep.pending == ThermalReading("Normal", 60, 16, 16, joules_per_token=0.43)
    figure[0] = None
    on_reading(ThermalReading("Throttled", 84, 13, 16))
    assert rep.pending == ThermalReading("Throttled", 84, 13, 16)


# ----------------------------------------------------------------------------- the runtime


def _metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def test_runtime_reports_joules_per_token_from_a_rapl_counter(
    runtime: tuple[Any, FakeThermalTree],
) -> None:
    """The real runtime on the fake tree: a RAPL counter appears beside the thermal zones (as
    the emulated device writes it), the runtime generates tokens, the counter advances, and
    /metrics divides the one by the other."""
    proc, tree = runtime
    zone = rapl(tree.root, "0", "package-0", 1_000_000, wrap=2**40)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=proc.url, headers=auth, timeout=120) as client:

        def scrape() -> str:
            return str(client.get("/metrics").text)

        # Two samples of the counter: the window has its start (no tokens yet, no figure).
        def figured() -> bool:
            return _metric(scrape(), "ember_energy_joules_total") is not None

        wait_for("the energy counter's first figure", figured, 10, 0.05)
        assert _metric(scrape(), "ember_joules_per_output_token") is None
        answer = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 16})
        assert answer.status_code == 200, answer.text
        tokens = answer.json()["usage"]["completion_tokens"]
        assert tokens > 0
        set_energy(zone, 1_000_000 + 24_000_000)  # 24 J used since the window began

        def counted(text: str) -> bool:
            return _metric(text, "ember_energy_joules_total") == 24.0

        text = wait_for("the 24 J to be counted", scrape, 10, 0.05, until=counted)
    per_token = _metric(text, "ember_joules_per_output_token")
    assert per_token == pytest.approx(24.0 / tokens)
    assert 'ember_joules_per_output_token{source="rapl"}' in text
    assert _metric(text, "ember_power_watts") is not None
