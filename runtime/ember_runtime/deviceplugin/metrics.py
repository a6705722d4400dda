"""Prometheus metrics of the device plugin, on their own registry (one per plugin instance)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ember_runtime.promserve import ServedRegistry

from .health import DeviceState


class PluginMetrics(ServedRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.devices = Gauge(
            "ember_npu_devices", "NPUs by health.", ["health"], registry=self.registry
        )
        self.contexts = Gauge(
            "ember_npu_contexts",
            "ACL contexts per NPU, free or used (live allocations).",
            ["device", "state"],
            registry=self.registry,
        )
        self.allocate_seconds = Histogram(
            "ember_npu_allocate_seconds",
            "Allocate latency, including the checkpoint fsync.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=self.registry,
        )
        self.allocate_errors = Counter(
            "ember_npu_allocate_errors",
            "Rejected Allocate calls.",
            ["code"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "ember_npu_registrations",
            "Registration attempts with the kubelet.",
            ["result"],
            registry=self.registry,
        )
        self.released = Counter(
            "ember_npu_contexts_released", "Context IDs released.", registry=self.registry
        )

    def observe_devices(
        self, states: Iterable[DeviceState], used: Mapping[str, int], per_device: int
    ) -> None:
        healthy = unhealthy = 0
        for state in states:
            if state.healthy:
                healthy += 1
            else:
                unhealthy += 1
            n = used.get(state.device.name, 0)
            self.contexts.labels(state.device.name, "used").set(n)
            self.contexts.labels(state.device.name, "free").set(max(per_device - n, 0))
        self.devices.labels("healthy").set(healthy)
        self.devices.labels("unhealthy").set(unhealthy)
