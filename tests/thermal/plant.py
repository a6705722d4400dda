"""A thermal plant that answers back: a device whose temperature follows its own work.

The model is the first-order (lumped RC) one of device thermal design guides::

    C · dT/dt = P(t) − (T − T_ambient) / R

with P the device's power, R its junction-to-ambient resistance (°C/W) and C its heat capacity
(J/°C); τ = R·C is the time constant. Power follows *measured work*: the CPU time the replica's
process actually consumed (/proc/<pid>/stat, every thread), as a share of the cores it may use at
full clock::

    P = P_idle + (P_max − P_idle) · utilisation

Why CPU time and not tokens/s through an energy-per-token curve: the CPU time is what the
engine really did, whatever its batch, prompt or sampling, so a smaller batch that makes the
engine busier per token heats the device more, as it would; a curve would only return the
assumption it was calibrated with. Linear in utilisation is conservative for the baselines: real
DVFS cuts power faster than clock (P ∝ f·V²), so a throttled device here stays hotter than real.

Like real silicon the device defends itself: at `throttle_celsius` its clock falls to
`throttled_fraction` (the replica's cgroup CPU quota: the field report's 45% for an Ascend 310P
at its power wall) until it cools `hysteresis_celsius` below; at `trip_celsius` it resets: the
replica's process is killed, the device draws nothing for `reset_seconds` (a reboot), then
`on_reset` brings the replica back. The plant writes the sysfs thermal zone the runtime's real
sensor reads, and a RAPL-style energy counter beside it (the power readers' emulation path).

Time may be compressed: `speed` emulated seconds pass per real second (τ and the reset scale by
it; the runtime's governor and the load run in real time). Profiles: `PROFILES`, their sources in
docs/thermal.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.gateway_overhead import cpu_seconds
from tests.support.net import free_port
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.runtime_proc import RuntimeProcess

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


@dataclass(frozen=True)
class Profile:
    """One box's thermal figures (sources: docs/thermal.md, 'Plant profiles')."""

    name: str
    idle_watts: float
    max_watts: float  # the module's power envelope at full load and clock
    resistance: float  # °C/W, junction to ambient through its heatsink
    capacitance: float  # J/°C, module + heatsink
    throttle_celsius: float  # where the firmware starts cutting clocks
    trip_celsius: float  # where it shuts down
    ambient_celsius: float = 25.0
    throttled_fraction: float = 0.45
    hysteresis_celsius: float = 5.0
    reset_seconds: float = 60.0  # from trip to serving again (boot + model load)

    @property
    def tau(self) -> float:
        return self.resistance * self.capacitance

    def steady(self, utilisation: float, ambient: float | None = None) -> float:
        """The temperature it settles at under constant work (no throttling)."""
        watts = self.idle_watts + (self.max_watts - self.idle_watts) * utilisation
        return (self.ambient_celsius if ambient is None else ambient) + self.resistance * watts


@dataclass
class PlantState:
    celsius: float
    watts: float = 0.0
    joules: float = 0.0  # since the start, emulated
    throttled: bool = False
    down_until: float | None = None  # emulated time the reset ends
    trips: int = 0
    throttled_seconds: float = 0.0  # emulated
    emulated: float = 0.0


class CpuQuota:
    """A cgroup v1 cpu child capping a process: `cpus` cores at full clock."""

    def __init__(self, name: str, cpus: float) -> None:
        self.path = CGROUP_CPU / f"ember-plant-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.cpus = cpus
        self.set(1.0)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def set(self, fraction: float) -> None:
        (self.path / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * self.cpus * fraction)))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # it exited meanwhile
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


@dataclass
class Device:
    """What the plant acts on: where it reads work and how it throttles and kills."""

    cpus: float  # the cores the replica may use at full clock
    work: Callable[[], float]  # cumulative CPU seconds of the replica (raises when it is gone)
    throttle: Callable[[float], None] = lambda fraction: None  # clock (CPU quota) fraction
    kill: Callable[[], None] = lambda: None
    on_reset: Callable[[], None] = lambda: None  # the box is back: start the replica again


def step(
    profile: Profile, state: PlantState, utilisation: float, dt: float, ambient: float
) -> list[str]:
    """Advance `dt` emulated seconds (pure, but for `state`); returns what happened."""
    events: list[str] = []
    state.emulated += dt
    down = state.down_until is not None
    state.watts = (
        0.0
        if down
        else profile.idle_watts
        + (profile.max_watts - profile.idle_watts) * max(0.0, min(1.0, utilisation))
    )
    # Exact solution over the step for constant power (stable for any dt, unlike Euler).
    target = ambient + profile.resistance * state.watts
    decay = pow(2.718281828459045, -dt / profile.tau)
    state.celsius = target + (state.celsius - target) * decay
    state.joules += state.watts * dt
    if down:
        if state.emulated >= (state.down_until or 0.0):
            state.down_until = None
            events.append("reset-done")
        return events
    if state.celsius >= profile.trip_celsius:
        state.trips += 1
        state.down_until = state.emulated + profile.reset_seconds
        state.throttled = False
        return [*events, "trip"]
    if not state.throttled and state.celsius >= profile.throttle_celsius:
        state.throttled = True
        events.append("throttle")
    elif state.throttled and state.celsius < profile.throttle_celsius - profile.hysteresis_celsius:
        state.throttled = False
        events.append("release")
    if state.throttled:
        state.throttled_seconds += dt
    return events


@dataclass
class Plant:
    """One device: a thread that samples its replica's work every `period` real seconds,
    advances the model, acts (throttle, trip, reset) and writes the sensor files."""

    profile: Profile
    device: Device
    tree: FakeThermalTree
    speed: float = 1.0  # emulated seconds per real second
    period: float = 0.25
    ambient: Callable[[float], float] | None = None  # emulated time → ambient °C
    log: list[tuple[float, float, float, bool, bool]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = PlantState(celsius=self._ambient(0.0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plant", daemon=True)
        self.tree.zone(0, "cpu-thermal", self.state.celsius)
        self._write()

    def _ambient(self, emulated: float) -> float:
        return self.profile.ambient_celsius if self.ambient is None else self.ambient(emulated)

    def start(self) -> Plant:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # a plant never started has nothing to join
            self._thread.join(timeout=5)

    def _utilisation(self, last: float | None, dt_real: float) -> tuple[float, float | None]:
        try:
            now = self.device.work()
        except OSError:  # the process is gone (tripped, restarting): no work
            return 0.0, None
        if last is None or now < last:
            return 0.0, now
        return (now - last) / (dt_real * self.device.cpus), now

    def _run(self) -> None:
        last_work: float | None = None
        last = time.monotonic()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            util, last_work = self._utilisation(last_work, now - last)
            dt = (now - last) * self.speed
            last = now
            was = self.state.throttled
            for event in step(
                self.profile, self.state, util, dt, self._ambient(self.state.emulated)
            ):
                self._act(event)
            if self.state.throttled != was and self.state.down_until is None:
                self.device.throttle(
                    self.profile.throttled_fraction if self.state.throttled else 1.0
                )
            self._write()
            self.log.append(
                (
                    self.state.emulated,
                    self.state.celsius,
                    self.state.watts,
                    self.state.throttled,
                    self.state.down_until is not None,
                )
            )

    def _act(self, event: str) -> None:
        self.events.append((self.state.emulated, event))
        if event == "trip":
            self.device.throttle(1.0)
            self.device.kill()
        elif event == "reset-done":
            self.device.on_reset()

    def _write(self) -> None:
        self.tree.set(0, self.state.celsius)
        energy = self.tree.root / "class" / "powercap" / "intel-rapl:0"
        energy.mkdir(parents=True, exist_ok=True)
        (energy / "name").write_text("package-0\n")
        (energy / "max_energy_range_uj").write_text(f"{2**40}\n")
        tmp = energy / "energy_uj.tmp"
        tmp.write_text(f"{int(self.state.joules * 1e6) % 2**40}\n")
        tmp.replace(energy / "energy_uj")


class PlantedRuntime:
    """A runtime process on a plant's device: in the device's CPU quota, SIGKILLed by its trip,
    and started again on the same port once the device has reset, as after a real thermal
    shutdown. `start(port)` starts one process (the caller's `start_runtime` arguments)."""

    def __init__(self, quota: CpuQuota, start: Callable[[int], RuntimeProcess]) -> None:
        self.quota, self._start = quota, start
        self.port = free_port()
        self.procs: list[RuntimeProcess] = []
        self.boot()

    def boot(self) -> None:
        if self.procs:
            self.procs[-1].proc.wait()  # the tripped one, reaped before its port is taken
        proc = self._start(self.port)
        self.quota.add(proc.proc.pid)
        self.procs.append(proc)

    def pid(self) -> int | None:
        proc = self.procs[-1].proc
        return proc.pid if proc.poll() is None else None

    def device(self) -> Device:
        device = process_device(self.pid, self.quota)
        device.on_reset = lambda: threading.Thread(target=self.boot, daemon=True).start()
        return device

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def process_device(pid: Callable[[], int | None], quota: CpuQuota) -> Device:
    """A Device over a local process: its CPU time, its cgroup quota, SIGKILL on trip."""

    def work() -> float:
        current = pid()
        if current is None:
            raise OSError("no process")
        return cpu_seconds(current)

    def kill() -> None:
        current = pid()
        if current is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(current, signal.SIGKILL)

    return Device(cpus=quota.cpus, work=work, throttle=quota.set, kill=kill)


# Figures and their sources: docs/thermal.md, "Plant profiles". Where no datasheet gives R or C
# they are estimated there from a published heat-up or steady-state measurement.
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # Passive heatsink, 25 W mode: trip points from NVIDIA's T234 thermal zones.
        Profile("jetson-orin-nx", 4.6, 25.0, 3.5, 350.0, 99.0, 104.5, throttled_fraction=0.6),
        # Small passive heatsink; the mainline device tree's CPU passive trip and critical trip.
        Profile("rk3588", 1.8, 11.0, 4.5, 100.0, 85.0, 115.0, throttled_fraction=0.6),
        # Atlas 300I Pro card in a server's airflow (35 °C inlet): the field report's 45% clock.
        Profile("ascend-310p", 12.0, 72.0, 0.9, 300.0, 100.0, 105.0, ambient_celsius=35.0),
        # An N100 box in a ~0.6 kg aluminium case: TjMax (TCC) and THERMTRIP.
        Profile("nuc-fanless", 6.0, 15.0, 4.0, 600.0, 105.0, 125.0, throttled_fraction=0.7),
    )
}
