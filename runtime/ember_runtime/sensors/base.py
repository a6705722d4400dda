"""The one interface every temperature source implements (sysfs, NVML, npu-smi, fakes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

# Readings outside this range are sensor faults, not temperatures: thermal zones report e.g.
# -273000 or 255000 millidegrees when a sensor is unpowered. Dropping them keeps one bad
# zone from throttling (or, worse, evicting) a healthy replica.
PLAUSIBLE_CELSIUS = (-40.0, 150.0)


class SensorUnavailableError(RuntimeError):
    """A configured source cannot work on this machine (no driver, no tool): say why."""


@runtime_checkable
class TemperatureSource(Protocol):
    def read(self) -> dict[str, float]:
        """Current temperatures in degrees Celsius, keyed by a stable sensor name."""


@runtime_checkable
class Diagnosed(Protocol):
    """A source that knows why some of its sensors give no reading (see `CompositeSource`)."""

    def problems(self) -> dict[str, str]:
        """{source name: why it gave no reading at the last read}; empty when all work."""


@runtime_checkable
class Telemetered(Protocol):
    """A source that reads more than temperatures (NVML: power, SM clock) at each `read()`."""

    def telemetry(self) -> dict[str, dict[str, float]]:
        """{sensor name: {quantity: value}} as of the last read, e.g.
        {"gpu0": {"power_watts": 112.0, "sm_clock_mhz": 1980.0}}; empty before any read."""


def telemetry_of(source: TemperatureSource) -> dict[str, dict[str, float]]:
    return source.telemetry() if isinstance(source, Telemetered) else {}


def problems_of(source: TemperatureSource) -> dict[str, str]:
    return source.problems() if isinstance(source, Diagnosed) else {}


def describe_problems(problems: Mapping[str, str]) -> str | None:
    """One line for a condition message and the logs: "nvml: NVML cannot start ..."."""
    if not problems:
        return None
    return "; ".join(f"{name}: {why}" for name, why in sorted(problems.items()))


def plausible(celsius: float) -> bool:
    low, high = PLAUSIBLE_CELSIUS
    return low <= celsius <= high


def hottest(temps: Mapping[str, float]) -> tuple[str, float] | None:
    """The (name, °C) of the hottest sensor: the thermal governor acts on the worst one."""
    if not temps:
        return None
    name = max(temps, key=lambda k: (temps[k], k))
    return name, temps[name]
