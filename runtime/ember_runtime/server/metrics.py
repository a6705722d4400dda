"""Prometheus metrics of one server instance (its own registry, so apps never collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember_runtime.engines.base import EngineState, StepStats
from ember_runtime.sensors.power import EnergySnapshot

# Latency buckets from 5 ms (one batched decode step of a small model) to a minute.
_LATENCY = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_SEQS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ember_time_to_first_token_seconds",
            "From admission to the first generated token.",
            buckets=_LATENCY,
            registry=r,
        )
        self.inter_token = Histogram(
            "ember_inter_token_latency_seconds",
            "Between consecutive tokens of one stream.",
            buckets=_LATENCY,
            registry=r,
        )
        self.generated_tokens = Counter(
            "ember_generated_tokens", "Completion tokens generated.", registry=r
        )
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.requests = Counter(
            "ember_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "ember_generations_finished", "Generations by finish reason.", ["reason"], registry=r
        )
        self.step_seconds = Histogram(
            "ember_engine_step_seconds",
            "One engine step (decode + sample).",
            buckets=_LATENCY,
            registry=r,
        )
        self.step_sequences = Histogram(
            "ember_engine_step_sequences",
            "Sequences decoded per engine step.",
            buckets=_SEQS,
            registry=r,
        )
        # Speculative decoding (engines/speculative.py): acceptance = accepted / drafted.
        self.drafted_tokens = Counter(
            "ember_speculative_drafted_tokens",
            "Draft tokens verified (speculative decoding).",
            registry=r,
        )
        self.accepted_tokens = Counter(
            "ember_speculative_accepted_tokens",
            "Draft tokens kept (speculative decoding).",
            registry=r,
        )
        self.queue_depth = Gauge("ember_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active = Gauge("ember_active_sequences", "Sequences in the batch.", registry=r)
        self.max_batch = Gauge("ember_max_batch_size", "Current max batch size.", registry=r)
        self.temperature = Gauge(
            "ember_device_temperature_celsius", "Last reading per sensor.", ["sensor"], registry=r
        )
        # NVML's other readings (sensors.nvml): what the GPU draws and how fast it clocks, so a
        # throttled GPU is told apart from a busy one.
        self.gpu_power = Gauge(
            "ember_gpu_power_watts",
            "Board power per GPU (NVML) or NPU (npu-smi).",
            ["sensor"],
            registry=r,
        )
        self.gpu_sm_clock = Gauge(
            "ember_gpu_sm_clock_mhz", "SM clock per GPU (NVML).", ["sensor"], registry=r
        )

    def output_tokens(self) -> float:
        """Completion tokens generated so far (what joules per token divides by)."""
        return sum(
            s.value
            for m in self.generated_tokens.collect()
            for s in m.samples
            if s.name.endswith("_total")
        )

    def bind_energy(self, snapshot: Callable[[], EnergySnapshot]) -> None:
        """ember_energy_joules_total, ember_power_watts and ember_joules_per_output_token,
        read from the energy monitor at scrape time (`sensors.power`)."""
        self.registry.register(EnergyCollector(snapshot))

    def bind_engine(self, state: Callable[[], EngineState]) -> None:
        """Gauges read the engine at scrape time rather than being pushed every step."""
        self.queue_depth.set_function(lambda: state().queued)
        self.active.set_function(lambda: state().active)
        self.max_batch.set_function(lambda: state().max_batch_size)

    def observe_step(self, stats: StepStats) -> None:
        # Called from the decode thread; prometheus_client metrics are thread-safe.
        self.step_seconds.observe(stats.seconds)
        self.step_sequences.observe(stats.sequences)
        if stats.drafted:
            self.drafted_tokens.inc(stats.drafted)
            self.accepted_tokens.inc(stats.accepted)

    def set_temperatures(self, temps: dict[str, float]) -> None:
        for sensor, celsius in temps.items():
            self.temperature.labels(sensor=sensor).set(celsius)

    def set_telemetry(self, telemetry: dict[str, dict[str, float]]) -> None:
        gauges = {"power_watts": self.gpu_power, "sm_clock_mhz": self.gpu_sm_clock}
        for sensor, values in telemetry.items():
            for quantity, value in values.items():
                gauge = gauges.get(quantity)
                if gauge is not None:
                    gauge.labels(sensor=sensor).set(value)


class EnergyCollector(Collector):
    """The energy monitor's figures at scrape time. Joules per output token is absent (not 0)
    while the window holds no tokens or no energy source reads."""

    def __init__(self, snapshot: Callable[[], EnergySnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        joules = CounterMetricFamily(
            "ember_energy_joules",
            "Energy the replica's device used since start, by power source.",
            labels=["source"],
        )
        watts = GaugeMetricFamily(
            "ember_power_watts", "Power at the last sample, by power source.", labels=["source"]
        )
        for source, value in sorted(snap.joules.items()):
            joules.add_metric([source], value)
        for source, value in sorted(snap.watts.items()):
            watts.add_metric([source], value)
        yield joules
        yield watts
        if snap.joules_per_token is not None and snap.source is not None:
            per_token = GaugeMetricFamily(
                "ember_joules_per_output_token",
                "Energy per completion token over the last minute, from one power source.",
                labels=["source"],
            )
            per_token.add_metric([snap.source], snap.joules_per_token)
            yield per_token
