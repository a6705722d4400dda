"""Sensors through their real code paths: a fake sysfs tree, a fake `npu-smi` executable,
and NVML's absence on this machine (no NVIDIA driver here). A sensor that cannot work gives no
reading and says why (`problems_of`); it never raises out of `build_source`."""

from __future__ import annotations

import asyncio
import contextlib
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.config import SensorConfig
from ember_runtime.sensors import (
    CompositeSource,
    Ewma,
    Retrying,
    SensorUnavailableError,
    SmoothedSource,
    TemperatureSource,
    ThermalZoneReader,
    build_source,
    hottest,
    problems_of,
    sample_forever,
    telemetry_of,
)
from ember_runtime.sensors.npu_smi import NpuSmiParseError, NpuSmiReader, parse_npu_smi_info
from ember_runtime.sensors.nvml import NvmlReader, decode_reasons
from ember_runtime.server.metrics import Metrics
from prometheus_client import generate_latest

from tests.support.waiting import wait_async
from tests.thermal.conftest import FIXTURES, FakeThermalTree


def test_thermal_zones_read_millidegrees(thermal_tree: FakeThermalTree) -> None:
    thermal_tree.zone(0, "x86_pkg_temp", 61.5)
    thermal_tree.zone(1, "acpitz", 40.0)
    thermal_tree.zone(2, "acpitz", 41.0)
    reader = ThermalZoneReader(thermal_tree.root)
    assert reader.read() == {"x86_pkg_temp": 61.5, "acpitz": 40.0, "acpitz/thermal_zone2": 41.0}


def test_zone_type_filter_and_implausible_values(thermal_tree: FakeThermalTree) -> None:
    thermal_tree.zone(0, "soc-thermal", 70.0)
    thermal_tree.zone(1, "battery", 95.0)  # hot, but not the accelerator
    thermal_tree.zone(2, "gpu-thermal", -273.0)  # an unpowered sensor
    (thermal_tree.root / "class/thermal/thermal_zone3").mkdir()  # no files: skipped
    reader = ThermalZoneReader(thermal_tree.root, types=["soc*", "gpu*"])
    assert reader.read() == {"soc-thermal": 70.0}


def test_missing_tree_is_unavailable_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(SensorUnavailableError, match=r"nothing/class/thermal does not exist"):
        ThermalZoneReader(tmp_path / "nothing").read()


def test_hottest() -> None:
    assert hottest({}) is None
    assert hottest({"a": 50.0, "b": 80.0, "c": 79.9}) == ("b", 80.0)


def test_ewma_fast_attack_slow_release() -> None:
    ewma = Ewma(rising=1.0, falling=0.5)
    assert ewma.update({"z": 70.0}) == {"z": 70.0}
    assert ewma.update({"z": 84.0}) == {"z": 84.0}  # heat counts at once
    assert ewma.update({"z": 74.0}) == {"z": 79.0}  # cooling is smoothed
    assert ewma.update({"z": 74.0}) == {"z": 76.5}
    assert ewma.update({}) == {}  # a vanished sensor is forgotten
    smooth = Ewma(rising=0.5, falling=0.5)
    smooth.update({"z": 70.0})
    assert smooth.update({"z": 80.0}) == {"z": 75.0}
    with pytest.raises(ValueError, match="rising"):
        Ewma(rising=0.0)


class Samples:
    """What `sample_forever` handed on, newest last, with its loop running on the test's loop."""

    def __init__(self, source: Any, interval: float) -> None:
        self.seen: list[dict[str, float]] = []
        self.task = asyncio.create_task(
            sample_forever(source, interval, lambda temps, _: self.seen.append(temps))
        )

    async def wait(self, ok: Callable[[tuple[str, float]], bool]) -> tuple[str, float]:
        def latest() -> tuple[str, float] | None:
            top = hottest(self.seen[-1]) if self.seen else None
            return top if top is not None and ok(top) else None

        found: tuple[str, float] = await wait_async("a sample", latest, timeout=5.0)
        return found

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_sampler_follows_the_fake_tree(thermal_tree: FakeThermalTree) -> None:
    thermal_tree.zone(0, "soc-thermal", 60.0)
    thermal_tree.zone(1, "npu-thermal", 70.0)
    source = SmoothedSource(ThermalZoneReader(thermal_tree.root), Ewma(1.0, 0.5))
    samples = Samples(source, interval=0.05)
    try:
        await samples.wait(lambda s: s[1] == 70.0)
        thermal_tree.set(0, 84.0)
        sample = await samples.wait(lambda s: s[0] == "soc-thermal")
        assert sample[1] == 84.0
        thermal_tree.set(0, 76.0)
        # The release is smoothed: 84 → 80 → 78 → 77 ... never a jump straight to 76.
        between = await samples.wait(lambda s: s[1] < 84.0)
        assert between[1] == 80.0
        thermal_tree.set(0, 50.0)
        last = await samples.wait(lambda s: s[0] == "npu-thermal")
        assert last[1] == 70.0
    finally:
        await samples.stop()


async def test_sampler_survives_a_failing_source() -> None:
    calls = []

    class Flaky:
        def read(self) -> dict[str, float]:
            calls.append(1)
            if len(calls) == 1:
                raise OSError("sensor went away")
            return {"z": 50.0}

    samples = Samples(Flaky(), interval=0.02)
    try:
        await samples.wait(lambda s: s[1] == 50.0)
        assert samples.seen[0] == {}  # the failed read: no reading, and the loop went on
    finally:
        await samples.stop()
    with pytest.raises(ValueError):
        await sample_forever(Flaky(), 0, lambda temps, _: None)


# ----------------------------------------------------------------------------- npu-smi


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "npu_smi_910b_8.txt",
            {f"npu{i}/chip0": t for i, t in enumerate([34, 34, 34, 33, 33, 34, 34, 33])},
        ),
        ("npu_smi_310p3.txt", {"npu6/chip0": 50.0}),
        ("npu_smi_310p3_x2.txt", {"npu0/chip0": 42.0, "npu1/chip0": 43.0}),
    ],
)
def test_parse_real_npu_smi_tables(fixture: str, expected: dict[str, float]) -> None:
    assert parse_npu_smi_info((FIXTURES / fixture).read_text()) == expected


def test_parse_rejects_other_output() -> None:
    with pytest.raises(NpuSmiParseError, match="Temp"):
        parse_npu_smi_info("dcmi module initialize failed. ret is -8005\n")


def _fake_npu_smi(tmp_path: Path, body: str) -> Path:
    """An executable that behaves like `npu-smi info`: prints the table in ./table.txt."""
    script = tmp_path / "npu-smi"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_npu_smi_reader_runs_the_tool_and_follows_it(tmp_path: Path) -> None:
    table = tmp_path / "table.txt"
    script = _fake_npu_smi(
        tmp_path,
        (
            "import sys, pathlib\n"
            "assert sys.argv[1:] == ['info'], sys.argv\n"
            f"print(pathlib.Path({str(table)!r}).read_text())\n"
        ),
    )
    text = (FIXTURES / "npu_smi_910b_8.txt").read_text()
    table.write_text(text)
    reader = NpuSmiReader([str(script), "info"])
    assert hottest(reader.read()) == ("npu6/chip0", 34.0)
    # Heat NPU 3 to 84 °C in the tool's output: the reader follows.
    table.write_text(text.replace("| 67.2        33  ", "| 67.2        84  "))
    assert hottest(reader.read()) == ("npu3/chip0", 84.0)


def test_npu_smi_failures_are_clear(tmp_path: Path) -> None:
    with pytest.raises(SensorUnavailableError, match="not found"):
        NpuSmiReader([str(tmp_path / "no-such-npu-smi"), "info"]).read()
    failing = _fake_npu_smi(tmp_path, "import sys\nprint('dcmi init failed')\nsys.exit(3)\n")
    with pytest.raises(SensorUnavailableError, match="exited 3: dcmi init failed"):
        NpuSmiReader([str(failing), "info"]).read()
    # Exit 0 with an error instead of the table (a driver that is not up yet).
    garbled = _fake_npu_smi(tmp_path, "print('dcmi module initialize failed. ret is -8005')\n")
    with pytest.raises(SensorUnavailableError, match="no header with Temp"):
        NpuSmiReader([str(garbled), "info"]).read()
    not_executable = tmp_path / "npu-smi-noexec"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(SensorUnavailableError, match="cannot run"):
        NpuSmiReader([str(not_executable), "info"]).read()
    with pytest.raises(ValueError):
        NpuSmiReader([])


def test_build_source_combines_zones_and_npu_smi(
    tmp_path: Path, thermal_tree: FakeThermalTree
) -> None:
    thermal_tree.zone(0, "soc-thermal", 55.0)
    script = _fake_npu_smi(
        tmp_path, (f"print(open({str(FIXTURES / 'npu_smi_310p3.txt')!r}).read())\n")
    )
    settings = SensorConfig(sysfs_root=str(thermal_tree.root), npu_smi=str(script))
    assert build_source(settings).read() == {"soc-thermal": 55.0, "npu6/chip0": 50.0}


def test_composite_keeps_working_sources() -> None:
    class Broken:
        def read(self) -> dict[str, float]:
            raise SensorUnavailableError("npu-smi not found")

    class Fine:
        def read(self) -> dict[str, float]:
            return {"ok": 40.0}

    composite = CompositeSource([Broken(), Fine()])
    assert composite.read() == {"ok": 40.0}
    assert problems_of(composite) == {"Broken": "npu-smi not found"}


def test_composite_problems_clear_when_a_source_recovers() -> None:
    class Flaky:
        name = "flaky"
        fail = True

        def read(self) -> dict[str, float]:
            if self.fail:
                raise RuntimeError("device gone")  # not only the expected error types
            return {"gpu0": 50.0}

    flaky = Flaky()
    composite = CompositeSource([flaky])
    assert composite.read() == {}
    assert composite.problems() == {"flaky": "device gone"}
    flaky.fail = False
    assert composite.read() == {"gpu0": 50.0}
    assert composite.problems() == {}


def test_retrying_builds_again_only_after_the_interval() -> None:
    now = [0.0]
    attempts: list[float] = []

    class Up:
        def read(self) -> dict[str, float]:
            return {"gpu0": 45.0}

    def factory() -> Up:
        attempts.append(now[0])
        if now[0] < 60:
            raise SensorUnavailableError("NVML cannot start (no NVIDIA driver?)")
        return Up()

    source = Retrying("nvml", factory, retry_seconds=30, clock=lambda: now[0])
    for t in (0.0, 10.0, 29.0):
        now[0] = t
        with pytest.raises(SensorUnavailableError, match="no NVIDIA driver"):
            source.read()
    assert attempts == [0.0]  # not at every sample
    now[0] = 30.0
    with pytest.raises(SensorUnavailableError):
        source.read()
    now[0] = 60.0
    assert source.read() == {"gpu0": 45.0}  # the driver came up: no restart needed
    assert attempts == [0.0, 30.0, 60.0]


# ----------------------------------------------------------------------------- NVML


def test_nvml_reader_without_a_driver_says_what_is_missing() -> None:
    """This machine has no NVIDIA driver: whether nvidia-ml-py is installed or not, the reader
    fails at construction with a message that says what is missing."""
    with pytest.raises(SensorUnavailableError, match=r"nvidia-ml-py|NVIDIA driver"):
        NvmlReader()


def test_nvml_configured_without_a_driver_degrades_to_the_other_sensors(
    thermal_tree: FakeThermalTree,
) -> None:
    """A GPU node whose image or driver lacks NVML: the thermal zones still count, and the
    cause is at hand for the condition (it used to raise here and crash-loop the runtime)."""
    thermal_tree.zone(0, "soc-thermal", 55.0)
    source = build_source(SensorConfig(sysfs_root=str(thermal_tree.root), nvml=True))
    assert source.read() == {"soc-thermal": 55.0}
    problems = problems_of(source)
    assert list(problems) == ["nvml"]
    assert re.search(r"nvidia-ml-py|NVIDIA driver", problems["nvml"])


def test_nvml_every_gpu_gone_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML started, then the GPU fell off the bus: no reading, with NVML's own error."""
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: object())

    def gone(*_: object) -> str:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", gone)
    reader = NvmlReader()
    with pytest.raises(SensorUnavailableError, match=r"every GPU: gpu0: GPU is lost"):
        reader.read()


def test_nvml_no_gpu_visible_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    with pytest.raises(SensorUnavailableError, match="sees no GPU"):
        NvmlReader()


def test_throttle_reason_bits() -> None:
    assert decode_reasons(0) == ()
    assert decode_reasons(0x1 | 0x40) == ("gpu_idle", "hw_thermal_slowdown")
    assert decode_reasons(0x20 | 0x4) == ("sw_power_cap", "sw_thermal_slowdown")


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, power: object) -> Any:
    """The real pynvml module with its device calls replaced: two GPUs, real names and errors."""
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H200")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda h, kind: 40 + h)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetClockInfo", lambda h, kind: 1980)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", lambda h: 0)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", power)
    return pynvml


def test_nvml_reports_power_and_sm_clock_through_every_wrapper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpus(monkeypatch, lambda h: 112_000 + 1000 * h)  # milliwatts, as NVML returns
    source = build_source(SensorConfig(nvml=True, zone_types=["none"]))
    assert telemetry_of(source) == {}  # nothing read yet
    assert source.read() == {"gpu0": 40.0, "gpu1": 41.0}
    assert telemetry_of(source) == {
        "gpu0": {"sm_clock_mhz": 1980.0, "power_watts": 112.0},
        "gpu1": {"sm_clock_mhz": 1980.0, "power_watts": 113.0},
    }


def test_nvml_board_without_power_sensor_keeps_its_temperature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def not_supported(_h: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a Jetson-class board

    _fake_gpus(monkeypatch, not_supported)
    reader = NvmlReader()
    assert reader.read() == {"gpu0": 40.0, "gpu1": 41.0}
    assert reader.telemetry()["gpu0"] == {"sm_clock_mhz": 1980.0}


def test_metrics_export_gpu_power_and_clock() -> None:
    metrics = Metrics()
    metrics.set_telemetry({"gpu0": {"power_watts": 112.5, "sm_clock_mhz": 1980.0}})
    text = generate_latest(metrics.registry).decode()
    assert 'ember_gpu_power_watts{sensor="gpu0"} 112.5' in text
    assert 'ember_gpu_sm_clock_mhz{sensor="gpu0"} 1980.0' in text


def test_thermal_zones_in_celsius(thermal_tree: FakeThermalTree) -> None:
    thermal_tree.zone(0, "cpu-thermal", 51.0)
    thermal_tree.zone(1, "gpu-thermal", 43.5)
    thermal_tree.zone(2, "cpu-thermal", 50.0)
    thermal_tree.zone(3, "broken", 0.0)
    (thermal_tree.root / "class/thermal/thermal_zone3/temp").write_text("n/a\n")
    reader = ThermalZoneReader(thermal_tree.root)
    assert isinstance(reader, TemperatureSource)
    assert reader.read() == {
        "cpu-thermal": 51.0,
        "gpu-thermal": 43.5,
        "cpu-thermal/thermal_zone2": 50.0,
    }


def test_no_thermal_zones_reads_empty(thermal_tree: FakeThermalTree) -> None:
    (thermal_tree.root / "class" / "thermal").mkdir(parents=True)  # sysfs there, no zone in it
    assert ThermalZoneReader(thermal_tree.root).read() == {}
