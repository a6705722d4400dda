"""Power sensors and the energy meter behind joules per output token.

Sources, each a reader whose `read()` gives `{domain: PowerReading}` (a cumulative energy counter
in joules, an instantaneous power in watts, or both), `SensorUnavailableError` when it has none:

- RAPL (`RaplReader`): `<sysfs_root>/class/powercap/intel-rapl:N/energy_uj`, a counter that wraps
  at `max_energy_range_uj`; top-level package domains only (`intel-rapl:N` named `package-*`: the
  `intel-rapl:N:M` core/uncore/dram subdomains are inside the package, `psys` contains it). The
  emulated device writes the same tree under the fake sysfs root, so it is the emulation's path.
- hwmon (`HwmonPowerReader`): `<sysfs_root>/class/hwmon/hwmon*/` of board power monitors (INA3221
  on Jetson, INA2xx): `power*_input` (µW), else `in*_input` (mV) × `curr*_input` (mA). A rail
  labelled as the module's input (`VDD_IN`, `POM_5V_IN`) is the total; without one, the rails sum.
- NVML and npu-smi: no reader of their own. The temperature readers already talk to the device at
  every sample (`NvmlReader`: board power and, where supported, the total-energy counter;
  `NpuSmiReader`: the table's Power(W)), and hand those on as telemetry (`accelerator_power`).

`EnergyMeter` integrates: counters by difference (a wrap adds the range; a counter that goes back
otherwise, a driver reload, counts nothing for that interval), powers by the trapezoid over the
interval. `JoulesPerTokenWindow` divides the joules of the last `window` seconds by the output
tokens of the same seconds. `EnergyMonitor` runs both at each temperature sample: `MeteredSource`
wraps the runtime's temperature source, so energy is read on the sampler's thread and schedule,
with no loop of its own. Without any power source, energy is simply absent (logged once).
"""

from __future__ import annotations

import fnmatch
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ember_runtime.sensors.base import (
    SensorUnavailableError,
    TemperatureSource,
    describe_problems,
    problems_of,
    telemetry_of,
)

log = logging.getLogger(__name__)

# The one figure (J/token) comes from one source, the first of these that reads: the accelerator's
# own sensor, else the board's input rail, else the CPU package. Summing them would count twice
# (a Jetson's VDD_IN contains its GPU; RAPL's psys contains the package).
PRIORITY = ("nvml", "npu-smi", "hwmon", "rapl")
HWMON_CHIPS = ("ina3221", "ina2*")  # board power monitors, not a CPU's or a disk's own sensors
TOTAL_RAILS = frozenset({"VDD_IN", "POM_5V_IN", "VIN"})
UNCONNECTED = frozenset({"NC", ""})
WINDOW_SECONDS = 60.0
_ACCELERATOR_KEYS = (("nvml", re.compile(r"gpu\d+")), ("npu-smi", re.compile(r"npu\d+/chip\d+")))


@dataclass(frozen=True)
class PowerReading:
    """One domain's reading: a cumulative counter (`joules`, wrapping at `wrap_joules` if set),
    an instantaneous power (`watts`), or both."""

    joules: float | None = None
    wrap_joules: float | None = None
    watts: float | None = None


Readings = Mapping[str, Mapping[str, PowerReading]]  # {source: {domain: reading}}


class PowerSource(Protocol):
    name: str

    def read(self) -> dict[str, PowerReading]: ...


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _text(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- RAPL


class RaplReader:
    """CPU package energy (Intel, and AMD Zen through the same powercap driver)."""

    name = "rapl"

    def __init__(self, sysfs_root: str | Path = "/sys") -> None:
        self._base = Path(sysfs_root) / "class" / "powercap"

    def read(self) -> dict[str, PowerReading]:
        if not self._base.is_dir():
            raise SensorUnavailableError(f"no powercap: {self._base} does not exist")
        out: dict[str, PowerReading] = {}
        for zone in sorted(self._base.glob("intel-rapl:*")):
            label = _text(zone / "name") or ""
            if zone.name.count(":") != 1 or not label.startswith("package"):
                continue
            micro = _number(zone / "energy_uj")  # root-only since Linux 5.10: None then
            if micro is not None:
                wrap = _number(zone / "max_energy_range_uj")
                out[label] = PowerReading(micro / 1e6, None if not wrap else wrap / 1e6)
        if not out:
            raise SensorUnavailableError(f"no readable package energy_uj under {self._base}")
        return out


# ----------------------------------------------------------------------------- hwmon


def _rails(chip: Path) -> dict[str, float]:
    """{label: watts} of one hwmon chip: power*_input, else in*_input × curr*_input pairs."""
    rails: dict[str, float] = {}
    for path in sorted(chip.glob("power*_input")):
        index = path.name.removeprefix("power").removesuffix("_input")
        micro = _number(path)
        if micro is not None:
            rails[_text(chip / f"power{index}_label") or f"power{index}"] = micro / 1e6
    if rails:
        return rails
    for path in sorted(chip.glob("curr*_input")):
        index = path.name.removeprefix("curr").removesuffix("_input")
        if _text(chip / f"in{index}_enable") == "0":
            continue  # a disabled INA3221 channel
        milliamps, millivolts = _number(path), _number(chip / f"in{index}_input")
        if milliamps is not None and millivolts is not None:
            label = _text(chip / f"in{index}_label") or _text(chip / f"curr{index}_label")
            rails[label or f"in{index}"] = millivolts * milliamps / 1e6
    return rails


class HwmonPowerReader:
    """Board power rails (a Jetson's INA3221): the module's input rail if labelled, else all."""

    name = "hwmon"

    def __init__(self, sysfs_root: str | Path = "/sys", chips: Sequence[str] = HWMON_CHIPS):
        self._base = Path(sysfs_root) / "class" / "hwmon"
        self._chips = tuple(chips)

    def read(self) -> dict[str, PowerReading]:
        if not self._base.is_dir():
            raise SensorUnavailableError(f"no hwmon: {self._base} does not exist")
        rails: dict[str, float] = {}
        for chip in sorted(self._base.glob("hwmon*")):
            kind = _text(chip / "name") or ""
            if any(fnmatch.fnmatchcase(kind, p) for p in self._chips):
                found = _rails(chip).items()
                rails.update({f"{chip.name}/{k}": w for k, w in found if k not in UNCONNECTED})
        if not rails:
            raise SensorUnavailableError(f"no power rail on a {'/'.join(self._chips)} chip")
        total = {k: w for k, w in rails.items() if k.partition("/")[2].upper() in TOTAL_RAILS}
        return {k: PowerReading(watts=w) for k, w in (total or rails).items()}


# ----------------------------------------------------------------------------- accelerators


def accelerator_power(
    telemetry: Mapping[str, Mapping[str, float]],
) -> dict[str, dict[str, PowerReading]]:
    """NVML's (`gpu<N>`) and npu-smi's (`npu<N>/chip<M>`) readings from the temperature source's
    telemetry, by source: `energy_joules` (NVML's counter) and `power_watts`."""
    out: dict[str, dict[str, PowerReading]] = {}
    for key, values in telemetry.items():
        source = next((s for s, k in _ACCELERATOR_KEYS if k.fullmatch(key)), None)
        joules, watts = values.get("energy_joules"), values.get("power_watts")
        if source is not None and (joules is not None or watts is not None):
            out.setdefault(source, {})[key] = PowerReading(joules=joules, watts=watts)
    return out


# ----------------------------------------------------------------------------- arithmetic


def joules_between(seconds: float, before: PowerReading, after: PowerReading) -> float:
    """The energy one domain used between two readings `seconds` apart."""
    if before.joules is not None and after.joules is not None:
        used = after.joules - before.joules
        if used < 0 and after.wrap_joules:
            used += after.wrap_joules  # the counter wrapped once (RAPL: every ~hour at 60 W)
        return max(0.0, used)  # still negative: the counter was reset, this interval is lost
    if before.watts is not None and after.watts is not None:
        return (before.watts + after.watts) / 2 * max(0.0, seconds)
    return 0.0


class EnergyMeter:
    """Joules per source since start, and its power now, from one set of readings per sample.
    A domain's first reading (and one that changes kind) counts from the next."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, PowerReading]] = {}
        self.joules: dict[str, float] = {}
        self.watts: dict[str, float] = {}

    def update(self, now: float, readings: Readings) -> dict[str, float]:
        """Fold in one sample; the joules each source used since the previous one (sources
        read in both samples only)."""
        used: dict[str, float] = {}
        watts: dict[str, float] = {}
        last: dict[tuple[str, str], tuple[float, PowerReading]] = {}
        for source, domains in readings.items():
            for domain, reading in domains.items():
                last[(source, domain)] = (now, reading)
                prev = self._last.get((source, domain))
                if prev is None:
                    continue
                seconds = now - prev[0]
                joules = joules_between(seconds, prev[1], reading)
                used[source] = used.get(source, 0.0) + joules
                power = reading.watts if reading.watts is not None else _rate(joules, seconds)
                watts[source] = watts.get(source, 0.0) + power
        self._last = last
        for source, joules in used.items():
            self.joules[source] = self.joules.get(source, 0.0) + joules
        self.watts = watts
        return used


def _rate(joules: float, seconds: float) -> float:
    return joules / seconds if seconds > 0 else 0.0


def primary(sources: Iterable[str]) -> str | None:
    """The source the J/token figure comes from (`PRIORITY`)."""
    present = set(sources)
    return next((s for s in PRIORITY if s in present), None)


class JoulesPerTokenWindow:
    """ΔE / Δtokens over the last `seconds`: cumulative (t, joules, tokens) samples, the oldest
    kept being the last one at or before the window's start. None without tokens in it."""

    def __init__(self, seconds: float = WINDOW_SECONDS) -> None:
        if seconds <= 0:
            raise ValueError(f"window must be > 0 s, got {seconds}")
        self._seconds = seconds
        self._samples: deque[tuple[float, float, float]] = deque()

    def add(self, now: float, joules: float, tokens: float) -> None:
        self._samples.append((now, joules, tokens))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self._seconds:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def value(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (_, j0, k0), (_, j1, k1) = self._samples[0], self._samples[-1]
        return (j1 - j0) / (k1 - k0) if k1 > k0 else None


# ----------------------------------------------------------------------------- the monitor


@dataclass(frozen=True)
class EnergySnapshot:
    joules: Mapping[str, float]  # since start, by source
    watts: Mapping[str, float]  # at the last sample, by source
    source: str | None  # where joules_per_token comes from
    joules_per_token: float | None  # over the window; None without tokens (or energy) in it


class EnergyMonitor:
    """The power readers, the meter and the J/token window, sampled with the temperatures.
    `sample` runs on the sampler's thread; `snapshot` from a scrape or a report: one lock."""

    def __init__(
        self,
        readers: Sequence[PowerSource],
        tokens: Callable[[], float] = lambda: 0.0,
        *,
        window_seconds: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._readers, self._tokens, self._clock = list(readers), tokens, clock
        self._meter = EnergyMeter()
        self._window = JoulesPerTokenWindow(window_seconds)
        self._source: str | None = None
        self._total = 0.0  # joules of the J/token source(s), as attributed sample by sample
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, PowerReading]]:
        readings: dict[str, dict[str, PowerReading]] = {}
        problems: dict[str, str] = {}
        for reader in self._readers:
            try:
                readings[reader.name] = reader.read()
            except Exception as exc:  # absent or broken: no energy from it, never an error
                problems[reader.name] = str(exc) or type(exc).__name__
        self._log_changes(problems)
        return readings

    def _log_changes(self, problems: dict[str, str]) -> None:
        """One line when what reads changes, not one per sample (no RAPL on an ARM board is
        normal: info, not a warning)."""
        if problems != self._problems and problems:
            log.info("no energy from %s", describe_problems(problems))
        for name in sorted(self._problems.keys() - problems.keys()):
            log.info("%s power reads again", name)
        self._problems = problems

    def sample(self, telemetry: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """Read every source (plus the accelerators' telemetry) and advance the meter."""
        readings = {**self._read(), **accelerator_power(telemetry or {})}
        tokens = float(self._tokens())
        with self._lock:
            now = self._clock()
            self._advance(now, self._meter.update(now, readings), tokens)

    def _advance(self, now: float, used: Mapping[str, float], tokens: float) -> None:
        source = primary(used)
        if source is None or source != self._source:
            self._window.clear()  # no energy, or another source: start the window again
        self._source = source
        if source is not None:
            self._total += used[source]
            self._window.add(now, self._total, tokens)

    def snapshot(self) -> EnergySnapshot:
        with self._lock:
            return EnergySnapshot(
                joules=dict(self._meter.joules),
                watts=dict(self._meter.watts),
                source=self._source,
                joules_per_token=self._window.value(),
            )

    def joules_per_token(self) -> float | None:
        return self.snapshot().joules_per_token


def build_monitor(sysfs_root: str | Path, tokens: Callable[[], float]) -> EnergyMonitor:
    """The runtime's monitor: RAPL and hwmon under the same sysfs root as the thermal zones
    (`sensors.sysfsRoot`); NVML and npu-smi come through the temperature source's telemetry
    (`MeteredSource`). `tokens`: the output tokens generated so far."""
    return EnergyMonitor([RaplReader(sysfs_root), HwmonPowerReader(sysfs_root)], tokens)


class MeteredSource:
    """A temperature source whose every read also samples energy: on the sampler's thread and
    schedule, no loop of its own. Energy never fails a temperature read."""

    def __init__(self, source: TemperatureSource, monitor: EnergyMonitor) -> None:
        self._source, self.monitor = source, monitor

    def read(self) -> dict[str, float]:
        try:
            return self._source.read()
        finally:
            try:
                self.monitor.sample(telemetry_of(self._source))
            except Exception:  # a bug here must not stop the thermal governor
                log.exception("energy sample failed")

    def problems(self) -> dict[str, str]:
        return problems_of(self._source)

    def telemetry(self) -> dict[str, dict[str, float]]:
        return telemetry_of(self._source)
