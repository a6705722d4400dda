"""Temperature sensors for the runtime's metrics and its thermal governor.

Every source implements `TemperatureSource.read() -> {name: °C}`: Linux thermal zones (sysfs),
NVIDIA GPUs (NVML; power and SM clock through `telemetry_of`), Ascend NPUs (`npu-smi info`).
`build_source(config.sensors)` combines the
configured ones behind an EWMA; `sample_forever` reads any source
on the event loop's behalf (the one sampling loop of the node side). A source
that cannot work here (no driver, no tool, no sysfs) gives no reading; `problems_of(source)` says
why, and the runtime reports it (reason `SensorUnavailable`) instead of failing.
`sensors.power` reads what the device draws (RAPL, hwmon rails, NVML's and npu-smi's power) at
the same samples, for joules per output token.
"""

from ember_runtime.sensors.base import (
    Diagnosed,
    SensorUnavailableError,
    Telemetered,
    TemperatureSource,
    hottest,
    problems_of,
    telemetry_of,
)
from ember_runtime.sensors.sampler import (
    CompositeSource,
    Ewma,
    Retrying,
    SmoothedSource,
    build_source,
    sample_forever,
)
from ember_runtime.sensors.thermal_zone import ThermalZoneReader

__all__ = [
    "CompositeSource",
    "Diagnosed",
    "Ewma",
    "Retrying",
    "SensorUnavailableError",
    "SmoothedSource",
    "Telemetered",
    "TemperatureSource",
    "ThermalZoneReader",
    "build_source",
    "hottest",
    "problems_of",
    "sample_forever",
    "telemetry_of",
]
