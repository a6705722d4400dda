"""The gateway's ASGI app: one OpenAI endpoint for every model of a site.

`/v1/models` lists every model the gateway serves (names are not secrets: any client of the
site may learn them); `/v1/completions`, `/v1/chat/completions` and `/v1/embeddings` go to a
replica of the model named in the body; anything else is a 404 in OpenAI's error shape (the
replicas' `/admin/*` and `/metrics` are never reachable through the gateway).

A model with `spec.scaling` and no healthy replica has its requests held (`hold`) while the
scaler (`scaler`, when the gateway has the API server) asks for a replica; `/v1/models` lists
it all the same, and each of its adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ember_runtime.asgi import BodyLimit
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.hold import Holds
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.proxy import (
    Call,
    Upstream,
    authorized,
    error,
    forward,
    prefix_text,
    unreachable,
    until_disconnect,
)
from ember_runtime.gateway.scaler import Scaler, SwapOrder, Writer

log = logging.getLogger(__name__)
PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# Discovery: keeps the fleet's routes current until cancelled.
Runner = Callable[[Fleet, GatewayMetrics], Coroutine[Any, Any, None]]


def upstream_client(connect_timeout: float, read_timeout: float) -> aiohttp.ClientSession:
    """Keep-alive HTTP/1.1 to the replicas; `read_timeout` bounds each wait for upstream bytes.
    aiohttp, not httpx: its C parser costs a quarter of httpx's CPU per relayed request
    (0.19 ms against 0.69-0.78 ms on this machine), which is most of the gateway's overhead."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout, sock_read=read_timeout
    )
    # Idle connections are dropped before the runtime's uvicorn drops them (after 5 s): a
    # request must never race a server-side close on a pooled connection.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    return aiohttp.ClientSession(
        timeout=timeout, connector=connector, auto_decompress=False, trust_env=False
    )


def parse(body: bytes) -> dict[str, Any] | Response:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        return error(400, "the request body must be a JSON object", code="invalid_json")
    if not isinstance(doc.get("model"), str):
        return error(400, "model is required and must be a string", param="model")
    return doc


@dataclass(frozen=True)
class Scaling:
    """The hold queue's bounds, and the scaler's writer (None: routes are not scaled, e.g. a
    static file) and periods (`settings.GatewaySettings` says what each is)."""

    hold_max_requests: int = 64
    hold_timeout: float = 120.0
    writer: Writer | None = None
    interval: float = 1.0
    swap_interval: float = 30.0
    swap_order: SwapOrder = "priority-lru"


class Gateway:
    def __init__(
        self, fleet: Fleet, discover: Runner, connect: float, read: float, scaling: Scaling
    ) -> None:
        self.fleet, self.discover = fleet, discover
        self.connect, self.read = connect, read
        self.metrics = GatewayMetrics()
        self.up: Upstream | None = None
        self.holds = Holds(fleet, self.metrics, scaling.hold_max_requests, scaling.hold_timeout)
        self.scaler = Scaler(
            fleet, self.holds, self.metrics, scaling.writer,
            interval=scaling.interval, swap_interval=scaling.swap_interval,
            order=scaling.swap_order,
        )  # fmt: skip

    async def proxy(self, request: Request) -> Response:
        started = time.perf_counter()
        body = await request.body()
        doc = parse(body)
        if isinstance(doc, Response):
            return doc
        model = doc["model"]
        route = self.fleet.routes.get(model)
        if route is None:
            message = f"The model `{model}` does not exist"
            return error(404, message, param="model", code="model_not_found")
        if not authorized(request, route):
            return error(401, "missing or invalid API key for this model", code="invalid_api_key")
        self.scaler.used(route)
        call = Call(route, request.url.path, body, request, prefix_text(doc))
        self.metrics.added.observe(time.perf_counter() - started)
        response = await until_disconnect(self._serve(call), request.receive)
        code = "499" if response is None else str(response.status_code)  # 499: client gone
        self.metrics.requests.labels(model, code).inc()
        return response if response is not None else Response(status_code=499)

    async def _serve(self, call: Call) -> Response:
        """Held first if its model is scaled and has no healthy replica; then forwarded. A
        scaled model's request that finds no replica reachable (its only one went between a
        probe and this request: a restart, a scale-down) is held again, within one hold
        timeout in all, instead of failing."""
        assert self.up is not None, "requests arrive only inside the lifespan"
        model = call.route.name
        deadline = time.monotonic() + self.holds.timeout
        while True:
            if call.route.scaling is not None and not self.fleet.healthy(model):
                refused = await self.holds.hold(model, deadline - time.monotonic())
                if refused is not None:
                    return refused
                route = self.fleet.routes.get(model)  # as it is now: its replicas came
                if route is None:
                    return error(404, f"The model `{model}` is gone", code="model_not_found")
                call = dataclasses.replace(call, route=route)
            response = await forward(self.up, call)
            if call.route.scaling is None or not unreachable(response):
                return response
            if time.monotonic() >= deadline:
                return response
            if self.fleet.healthy(model):  # timed out, not refused: its probe decides
                await asyncio.sleep(self.fleet.interval)

    async def models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": route.owner.split("/")[0]}
            for name, route in sorted(self.fleet.routes.items())
        ]
        return JSONResponse({"object": "list", "data": data})

    async def readyz(self, request: Request) -> Response:
        if self.fleet.ready():
            return PlainTextResponse("ready")
        return PlainTextResponse("no replica answers", status_code=503)

    async def prometheus(self, request: Request) -> Response:
        for name in self.fleet.routes:
            healthy = sum(r.healthy for r in self.fleet.replicas(name))
            self.metrics.healthy.labels(name).set(healthy)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with upstream_client(self.connect, self.read) as client:
            self.up = Upstream(client, self.fleet, self.metrics)
            tasks = [
                asyncio.create_task(self.fleet.probe_forever(client)),
                asyncio.create_task(self.discover(self.fleet, self.metrics)),
            ]
            if self.scaler.writer is not None:
                tasks.append(asyncio.create_task(self.scaler.run()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok")


async def not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route {request.url.path}", code="not_found")


async def internal(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error(500, "the gateway failed on this request", code="gateway_error")


async def not_allowed(request: Request, exc: Exception) -> Response:
    message = f"{request.method} is not allowed on {request.url.path}"
    return error(405, message, code="method_not_allowed")


def create_app(
    fleet: Fleet,
    discover: Runner,
    *,
    connect_timeout: float = 1.0,
    read_timeout: float = 600.0,
    max_body_bytes: int = 16 * 1024 * 1024,
    scaling: Scaling | None = None,
) -> Starlette:
    gateway = Gateway(fleet, discover, connect_timeout, read_timeout, scaling or Scaling())
    routes = [Route(p, gateway.proxy, methods=["POST"]) for p in PROXIED] + [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", gateway.readyz, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {404: not_found, 405: not_allowed, Exception: internal}
    app = Starlette(routes=routes, lifespan=gateway.lifespan, exception_handlers=handlers)
    app.state.gateway = gateway
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app
