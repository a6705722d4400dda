"""Requests held for a scaled model that has no healthy replica (scale to zero, issue 47).

A request for a model with `spec.scaling` and no healthy replica waits here, in a bounded
per-model queue, until a replica of that model answers its probe (`Fleet.until_healthy`); then
it is forwarded as any other. Every waiting request is demand the scaler sees at once (`wake`):
a model at zero is asked for a replica by the first request held for it.

Refusals are 503s with `Retry-After`, in OpenAI's error shape, so a client's own retry (the
openai client honours `Retry-After`) comes back later instead of piling up here:
- the queue is full (`max_requests` waiting already): at once;
- no replica came within `timeout` seconds.
A client that goes away while held leaves the queue: the caller runs `hold` under
`proxy.until_disconnect`, which cancels it, and the count drops in `finally`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from starlette.responses import Response

from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.proxy import error

# What a refused client is told to wait: about a replica's start from the node cache (the
# prewarm copy, the load), not the whole hold timeout, which a busy queue may never need again.
RETRY_AFTER_SECONDS = 5


def unavailable(message: str, code: str) -> Response:
    response = error(503, message, code=code)
    response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


class Holds:
    def __init__(
        self,
        fleet: Fleet,
        metrics: GatewayMetrics,
        max_requests: int = 64,
        timeout: float = 120.0,
    ) -> None:
        self.fleet, self.metrics = fleet, metrics
        self.max_requests, self.timeout = max_requests, timeout
        self.waiting: Counter[str] = Counter()  # by model name
        self.wake: Callable[[], None] = lambda: None  # the scaler's: demand changed

    def held(self, model: str) -> int:
        return self.waiting[model]

    async def hold(self, model: str, timeout: float | None = None) -> Response | None:
        """None once `model` has a healthy replica; else the 503 the client gets. `timeout`:
        what is left of this request's hold (default: all of it)."""
        timeout = self.timeout if timeout is None else timeout
        if self.waiting[model] >= self.max_requests:
            message = f"{model} is starting and {self.max_requests} requests wait for it already"
            return unavailable(message, "hold_queue_full")
        self._count(model, +1)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self.fleet.until_healthy(model)
        except TimeoutError:
            message = f"no replica of {model} became ready within {self.timeout:g} s"
            return unavailable(message, "hold_timeout")
        finally:
            self._count(model, -1)
        return None

    def _count(self, model: str, step: int) -> None:
        self.waiting[model] += step
        if self.waiting[model] <= 0:
            del self.waiting[model]
        self.metrics.held.labels(model).set(self.waiting[model])
        self.wake()
