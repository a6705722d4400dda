"""Smoothing and sampling: per-sensor EWMA, several sources as one, the one sampling loop.

The EWMA is asymmetric on purpose ("fast attack, slow release", as in audio limiters and the
kernel's step_wise governor reacting at trip points): a rising reading is weighted `rising`
(default 1.0: a real heat-up reaches the policy in one sample, so the batch shrinks within the
2 s budget: ≤ 1 s sample + ≤ 1 s operator poll), a falling one `falling` (default 0.5: one cool
sample — a fan burst, a sensor glitch — does not restore the full batch; a step down of 10 °C
shows as 5, 7.5, 8.75 ... so the release lags ~2-3 samples, on top of the policy's hysteresis).
Implausible readings are dropped by the readers before they get here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from ember_runtime.contract.config import SensorConfig
from ember_runtime.sensors.base import (
    SensorUnavailableError,
    TemperatureSource,
    describe_problems,
    problems_of,
    telemetry_of,
)
from ember_runtime.sensors.npu_smi import NpuSmiReader
from ember_runtime.sensors.nvml import NvmlReader
from ember_runtime.sensors.thermal_zone import ThermalZoneReader

log = logging.getLogger(__name__)

# How often a source that could not start (NVML without a driver) is tried again: each try
# loads a library or runs a tool, so not at every sample.
RETRY_SECONDS = 30.0


class Ewma:
    """Per-key exponentially weighted moving average with separate rise/fall weights."""

    def __init__(self, rising: float = 1.0, falling: float = 0.5) -> None:
        for name, alpha in (("rising", rising), ("falling", falling)):
            if not 0.0 < alpha <= 1.0:
                raise ValueError(f"EWMA {name} weight must be in (0, 1], got {alpha}")
        self._rising, self._falling = rising, falling
        self._values: dict[str, float] = {}

    def update(self, sample: dict[str, float]) -> dict[str, float]:
        """Fold in one sample; sensors absent from it are forgotten (a device went away)."""
        out: dict[str, float] = {}
        for key, value in sample.items():
            prev = self._values.get(key)
            if prev is None:
                out[key] = value
            else:
                alpha = self._rising if value >= prev else self._falling
                out[key] = prev + alpha * (value - prev)
        self._values = out
        return {k: round(v, 2) for k, v in out.items()}


def source_name(source: TemperatureSource) -> str:
    return str(getattr(source, "name", type(source).__name__))


class Retrying:
    """A source built on first use, and built again at most every `retry_seconds` while that
    fails: NVML without a driver must not stop the server, and a driver that comes up later (or
    a GPU handed to the container after a restart of the device plugin) is picked up without a
    pod restart. Until then `read()` raises `SensorUnavailableError` with the cause."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], TemperatureSource],
        retry_seconds: float = RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._factory, self._retry, self._clock = factory, retry_seconds, clock
        self._source: TemperatureSource | None = None
        self._error: str | None = None
        self._next_try = float("-inf")

    def _build(self) -> TemperatureSource | None:
        now = self._clock()
        if now < self._next_try:
            return None
        try:
            self._source = self._factory()
        except Exception as exc:  # any init failure (a broken library too) means "no reading"
            self._error = str(exc) or type(exc).__name__
            self._next_try = now + self._retry
            return None
        self._error = None
        log.info("%s sensor started", self.name)
        return self._source

    def read(self) -> dict[str, float]:
        source = self._source or self._build()
        if source is None:
            raise SensorUnavailableError(self._error or f"{self.name} not started")
        return source.read()

    def telemetry(self) -> dict[str, dict[str, float]]:
        return {} if self._source is None else telemetry_of(self._source)


class CompositeSource:
    """Several sources read as one. A failing source gives no reading, the others still count,
    and `problems()` says why (logged when it starts, changes or clears, not at every read)."""

    def __init__(self, sources: Sequence[TemperatureSource]) -> None:
        self._sources = list(sources)
        self._problems: dict[str, str] = {}

    def read(self) -> dict[str, float]:
        temps: dict[str, float] = {}
        problems: dict[str, str] = {}
        for source in self._sources:
            name = source_name(source)
            try:
                temps.update(source.read())
            except Exception as exc:  # one broken source must not hide the others' readings
                problems[name] = str(exc) or type(exc).__name__
        self._log_changes(problems)
        self._problems = problems
        return temps

    def _log_changes(self, problems: dict[str, str]) -> None:
        for name, why in problems.items():
            if self._problems.get(name) != why:
                log.warning("%s sensor gives no reading: %s", name, why)
        for name in self._problems.keys() - problems.keys():
            log.info("%s sensor reads again", name)

    def problems(self) -> dict[str, str]:
        return dict(self._problems)

    def telemetry(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for source in self._sources:
            out.update(telemetry_of(source))
        return out


class SmoothedSource:
    """A source whose every `read()` is one EWMA step: drop-in for the runtime's polling loop."""

    def __init__(self, source: TemperatureSource, ewma: Ewma | None = None) -> None:
        self._source = source
        self._ewma = ewma or Ewma()
        self._lock = threading.Lock()

    def read(self) -> dict[str, float]:
        sample = self._source.read()
        with self._lock:
            return self._ewma.update(sample)

    def problems(self) -> dict[str, str]:
        return problems_of(self._source)

    def telemetry(self) -> dict[str, dict[str, float]]:
        return telemetry_of(self._source)  # raw, not smoothed: power moves by the millisecond


def build_source(settings: SensorConfig) -> SmoothedSource:
    """The runtime's source from its config: thermal zones, plus NVML / npu-smi if configured.

    Never raises for a sensor that cannot work here: its reads fail instead, and the source's
    `problems()` carries the cause to the governor, the pod condition and `/admin/state`."""
    zones = ThermalZoneReader(settings.sysfs_root, settings.zone_types)
    sources: list[TemperatureSource] = [zones]
    if settings.nvml:
        sources.append(Retrying("nvml", NvmlReader))
    if settings.npu_smi:
        sources.append(NpuSmiReader([settings.npu_smi, "info"]))
    ewma = Ewma(settings.ewma_rising, settings.ewma_falling)
    return SmoothedSource(CompositeSource(sources), ewma)


# What a sample hands on: the smoothed readings ({} when the read failed) and, when some sensor
# cannot work, one line saying why (`describe_problems`).
OnSample = Callable[[dict[str, float], str | None], None]


async def sample_forever(source: TemperatureSource, interval: float, on_sample: OnSample) -> None:
    """The node side's one sampling loop (the runtime's governor, the node agent's condition):
    until cancelled, every `interval` s, read `source` and hand the reading to `on_sample`.

    The read runs in a thread so a slow source — `npu-smi` can take ~1 s — never blocks the
    event loop; reads are serialised, so a slow read delays the next one instead of piling up.
    A broken sensor is "no reading" with a cause, never the end of the loop."""
    if interval <= 0:
        raise ValueError(f"sampling interval must be > 0, got {interval}")
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            temps = await asyncio.to_thread(source.read)
            problem = describe_problems(problems_of(source))
        except Exception as exc:  # a broken sensor must not take serving down: no reading
            log.exception("temperature read failed")
            temps, problem = {}, f"{type(source).__name__}: {exc}"
        on_sample(temps, problem)
        await asyncio.sleep(max(0.0, interval - (loop.time() - started)))
