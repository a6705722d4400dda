"""Temperature sensors for the runtime's metrics and its thermal governor.

Every source implements `TemperatureSource.read() -> {name: °C}`: Linux thermal zones (sysfs),
NVIDIA GPUs (NVML), Ascend NPUs (`npu-smi info`). `build_source(config.sensors)` combines the
configured ones behind an EWMA; `Sampler` reads any source on a background thread.
"""

from ember_runtime.sensors.base import SensorUnavailableError, TemperatureSource, hottest
from ember_runtime.sensors.sampler import (
    CompositeSource,
    Ewma,
    Sample,
    Sampler,
    SmoothedSource,
    build_source,
)
from ember_runtime.sensors.thermal_zone import ThermalZoneReader

__all__ = [
    "CompositeSource",
    "Ewma",
    "Sample",
    "Sampler",
    "SensorUnavailableError",
    "SmoothedSource",
    "TemperatureSource",
    "ThermalZoneReader",
    "build_source",
    "hottest",
]
