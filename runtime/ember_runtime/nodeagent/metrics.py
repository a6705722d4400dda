"""The node agent's Prometheus metrics, on their own registry (one per agent instance).

What a site's WAN link carries is the question these answer: bytes fetched into the node cache
by where they came from (`source`: `origin` or `peer`), counted per chunk as they are written,
so an interrupted or refused transfer counts what crossed the link; bytes this node served to
its site peers; and files placed, by source. The labels are a fixed pair, never a digest or a
peer's address: a fleet's models and nodes would make the series unbounded, and the agent's
log names them per transfer. Beside them, how many rollout stage requests stand on the node
(a gauge, no label).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ember_runtime.promserve import ServedRegistry

ORIGIN, PEER = "origin", "peer"


class AgentMetrics(ServedRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.fetched_bytes = Counter(
            "ember_nodeagent_fetched_bytes",
            "Model bytes written into the node cache, by source (origin or peer).",
            ["source"],
            registry=self.registry,
        )
        self.fetched_files = Counter(
            "ember_nodeagent_fetched_files",
            "Verified files placed in the node cache, by source (origin or peer).",
            ["source"],
            registry=self.registry,
        )
        self.served_bytes = Counter(
            "ember_nodeagent_peer_served_bytes",
            "Cache bytes sent to site peers.",
            registry=self.registry,
        )
        # No label: which objects are staged is in the log ("stage request ... picked up").
        self.stage_requests = Gauge(
            "ember_nodeagent_stage_requests",
            "Rollout stage requests standing on this node's own Node (stage.ember.dev/).",
            registry=self.registry,
        )
        for source in (ORIGIN, PEER):  # both series exist from the start, at 0
            self.fetched_bytes.labels(source)
            self.fetched_files.labels(source)

    def meter(self, source: str) -> Counter:
        """The byte counter of one source (its `inc` is what the download loop calls)."""
        return self.fetched_bytes.labels(source)
