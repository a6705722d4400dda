"""NVIDIA GPUs through NVML (`nvidia-ml-py`, imported as `pynvml` only when this source is used).

Besides temperature, NVML says what a GPU draws and *why* it is slow: board power (and the
total-energy counter, for joules per token: `sensors.power`), the SM clock and the clock-event
("throttle") reasons. Those go to `details()`; `read()` returns temperatures
only, like every other source, and keeps power and clock for `telemetry()` (the runtime's
`/metrics`). Without the package, the driver or a GPU, construction raises
`SensorUnavailableError` with the reason; so does `read()` once every GPU has fallen off the bus.
`build_source` wraps this reader in `Retrying`: the runtime serves without a GPU temperature and
reports why (reason `SensorUnavailable` on its `ember.dev/Thermal` condition) instead of
crash-looping.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ember_runtime.sensors.base import SensorUnavailableError, plausible

log = logging.getLogger(__name__)

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
# Bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h, stable across driver versions).
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    temperature_celsius: float
    sm_clock_mhz: int
    throttle_reasons: tuple[str, ...]
    power_watts: float | None = None  # None where the board has no power sensor (NotSupported)
    energy_joules: float | None = None  # since the driver loaded (Volta and later), else None


def decode_reasons(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in sorted(THROTTLE_REASONS.items()) if mask & bit)


def _load() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise SensorUnavailableError(
            "NVML sensor configured but nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        ) from exc


class NvmlReader:
    """GPU temperatures keyed `gpu<index>`; all GPUs visible to the container count."""

    name = "nvml"

    def __init__(self) -> None:
        self._nvml = _load()
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise SensorUnavailableError(f"NVML cannot start (no NVIDIA driver?): {exc}") from exc
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
            self._handles: list[Any] = [
                self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)
            ]
        except self._nvml.NVMLError as exc:  # a GPU gone between the count and the handle
            self.close()
            raise SensorUnavailableError(f"NVML cannot list the GPUs: {exc}") from exc
        if not self._handles:
            self.close()
            raise SensorUnavailableError("NVML sees no GPU (is one allocated to this container?)")
        self._failing: set[int] = set()
        self._last: list[GpuReading] = []

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)

    def _reasons(self, handle: Any) -> int:
        # Renamed in newer drivers ("clocks event"); the bits are the same.
        getter = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if getter is None:
            getter = self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(getter(handle))

    def _power(self, handle: Any) -> float | None:
        # Milliwatts. Jetson-class and some passively cooled boards have no power sensor:
        # that is no reason to drop the GPU's temperature.
        try:
            return int(self._nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0
        except self._nvml.NVMLError_NotSupported:
            return None

    def _energy(self, handle: Any) -> float | None:
        # Millijoules since the driver loaded: the exact joules-per-token source where the GPU
        # has it (Volta+). Any NVML error (NotSupported, FunctionNotFound on an old driver) means
        # no counter, never no temperature: the meter falls back to integrating the power.
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)) / 1000.0
        except self._nvml.NVMLError:
            return None

    def details(self) -> list[GpuReading]:
        """Every GPU that answers; `SensorUnavailableError` when none does."""
        out, errors = [], {}
        for index, handle in enumerate(self._handles):
            try:
                name = self._nvml.nvmlDeviceGetName(handle)
                temp = float(self._nvml.nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU))
                clock = int(self._nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM))
                mask = self._reasons(handle)
                power = self._power(handle)
                energy = self._energy(handle)
            except self._nvml.NVMLError as exc:  # a GPU fell off the bus: report the others
                errors[index] = str(exc)
                continue
            text = name.decode() if isinstance(name, bytes) else str(name)
            reasons = decode_reasons(mask)
            out.append(GpuReading(index, text, temp, clock, reasons, power, energy))
        if set(errors) != self._failing:  # log changes only: reads run several times a second
            for index in sorted(set(errors) - self._failing):
                log.warning("gpu%d: NVML read failed: %s", index, errors[index])
            self._failing = set(errors)
        if errors and not out:
            first = min(errors)
            detail = f"gpu{first}: {errors[first]}"
            raise SensorUnavailableError(f"NVML read failed on every GPU: {detail}")
        return out

    def read(self) -> dict[str, float]:
        self._last = self.details()
        return {
            f"gpu{r.index}": r.temperature_celsius
            for r in self._last
            if plausible(r.temperature_celsius)
        }

    def telemetry(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for r in self._last:
            values = {"sm_clock_mhz": float(r.sm_clock_mhz)}
            if r.power_watts is not None:
                values["power_watts"] = r.power_watts
            if r.energy_joules is not None:
                values["energy_joules"] = r.energy_joules
            out[f"gpu{r.index}"] = values
        return out
