"""A Prometheus registry of a node-side process, served on a background thread.

The device plugin and the node agent each keep their metrics on their own registry (one per
instance, so tests can run several side by side) and serve it with prometheus_client's own
HTTP server; this is that shared part.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class ServedRegistry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on a background thread; return the bound port (0: any free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
