"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer and slow every SSE chunk).

The request body limit, which the gateway puts in front too, is the shared layer's (`asgi`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember_runtime.server.metrics import Metrics

_ENDPOINTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/batch", "/admin/state"}
)


class RequestCounter:
    """Count API requests by endpoint and status code as the response starts."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(("/v1/", "/admin/")):
            await self.app(scope, receive, send)
            return
        counter = self.metrics.requests
        endpoint = path if path in _ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                counter.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
