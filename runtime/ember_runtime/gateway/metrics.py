"""The gateway's Prometheus metrics, on its own registry (several gateways in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ember_gateway_requests",
            "Requests answered, by model and status code.",
            ["model", "code"],
            registry=self.registry,
        )
        self.retries = Counter(
            "ember_gateway_retries",
            "Attempts moved to another replica before the first byte, by cause.",
            ["model", "cause"],
            registry=self.registry,
        )
        self.chosen = Counter(
            "ember_gateway_replica_requests",
            "Requests sent to a replica (attempts, failed or not).",
            ["model", "replica"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "ember_gateway_upstream_errors",
            "Upstream failures: connect, reset, timeout, status 429/503, or a cut stream.",
            ["model", "kind"],
            registry=self.registry,
        )
        self.added = Histogram(
            "ember_gateway_added_seconds",
            "Gateway time before the upstream request is sent (parse, auth, choice).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
            registry=self.registry,
        )
        self.healthy = Gauge(
            "ember_gateway_healthy_replicas",
            "Replicas answering their probes, by model.",
            ["model"],
            registry=self.registry,
        )
        self.conflicts = Gauge(
            "ember_gateway_model_conflicts",
            "InferenceDeployments refused because an older one serves the same model name.",
            registry=self.registry,
        )
        self.held = Gauge(
            "ember_gateway_held_requests",
            "Requests waiting for a replica of a scaled model (scale to zero).",
            ["model"],
            registry=self.registry,
        )
        self.scale_writes = Counter(
            "ember_gateway_scale_writes",
            "spec.replicas written through the scale subresource, by InferenceDeployment"
            " (namespace/name: a base model and its adapters scale together) and direction.",
            ["deployment", "direction"],
            registry=self.registry,
        )
        self.swaps = Counter(
            "ember_gateway_swaps",
            "Replicas scaled down to make room for a model whose pod does not fit, by victim.",
            ["deployment"],
            registry=self.registry,
        )
