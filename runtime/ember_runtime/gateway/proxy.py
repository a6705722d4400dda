"""One request through the gateway: parse, authenticate, choose, send, fail over, relay.

Failover: a connect error, a reset, a timeout or a 429/503 from a replica *before the first
byte of its body* moves the request to the next candidate; nothing has reached the client yet.
Once the first body byte is in hand the response is committed and nothing is retried: a stream
cut after that ends the client's connection without the closing chunk, so the client sees an
incomplete response, never a duplicated or spliced one.

Only the headers the runtime needs cross: Content-Type, Accept, and the replica's own
Authorization. The client's Authorization, cookies, X-Forwarded-* and every other header stay at
the gateway; the upstream URL is the replica's address plus a fixed path, never the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ember_runtime.contract.errors import error_body
from ember_runtime.gateway.fleet import Fleet, Replica
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.routes import ModelRoute

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 503})
# Failures that prove the replica never produced a byte of this response.
BEFORE_FIRST_BYTE = (aiohttp.ClientError, TimeoutError)
_PASS_BACK = ("content-type", "cache-control", "x-accel-buffering", "retry-after")


def error(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status)


def prefix_text(doc: dict[str, Any]) -> str:
    """The text a request starts with, for prefix affinity (the first prompt, or the messages
    in order); token-id prompts as their decimal ids."""
    if "messages" in doc:
        parts = []
        for message in doc["messages"] if isinstance(doc["messages"], list) else []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content or ''}\n")
        return "".join(parts)
    prompt = doc.get("prompt", doc.get("input", ""))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # several prompts: the first
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt[:256])
    return prompt if isinstance(prompt, str) else ""


def authorized(request: Request, route: ModelRoute) -> bool:
    if route.api_key is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), route.api_key.encode()
    )


@dataclass
class Upstream:
    client: aiohttp.ClientSession
    fleet: Fleet
    metrics: GatewayMetrics


@dataclass(frozen=True)
class Call:
    """One client request, parsed: what every attempt sends."""

    route: ModelRoute
    path: str
    body: bytes
    request: Request
    prompt: str


@dataclass
class _Committed:
    replica: Replica
    response: aiohttp.ClientResponse
    chunks: AsyncIterator[bytes]
    first: bytes


@dataclass(frozen=True)
class _Refused:
    """A 429 or 503, read whole: what the client gets if every replica refuses."""

    status: int
    headers: dict[str, str]
    body: bytes


async def _attempt(up: Upstream, replica: Replica, call: Call) -> _Committed | _Refused:
    """A committed response, or a retryable refusal; transport errors raise."""
    headers = {
        "Content-Type": call.request.headers.get("content-type", "application/json"),
        "Accept": call.request.headers.get("accept", "*/*"),
        "Accept-Encoding": "identity",
        **replica.auth(),
    }
    response = await up.client.post(
        replica.backend.url + call.path, data=call.body, headers=headers
    )
    try:
        if response.status in RETRY_STATUS:
            body = await response.read()
            kept = {k: v for k, v in response.headers.items() if k.lower() in _PASS_BACK}
            response.release()
            return _Refused(response.status, kept, body)
        chunks = response.content.iter_any()
        first = await anext(chunks, b"")
    except BaseException:
        response.close()
        raise
    return _Committed(replica, response, chunks, first)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "timeout" if isinstance(exc, TimeoutError) else "reset"


async def forward(up: Upstream, call: Call) -> Response:
    """Try the candidates in policy order until one commits; the client's answer."""
    last: _Refused | None = None
    model = call.route.name
    for replica in up.fleet.order(model, call.prompt):
        replica.inflight += 1
        up.metrics.chosen.labels(model, replica.backend.key).inc()
        try:
            outcome = await _attempt(up, replica, call)
        except BEFORE_FIRST_BYTE as exc:
            replica.inflight -= 1
            cause = _cause(exc)
            if cause == "connect":
                up.fleet.mark_down(replica)
            up.metrics.upstream_errors.labels(model, cause).inc()
            up.metrics.retries.labels(model, cause).inc()
            log.info("%s: %s failed before the first byte: %r", model, replica.backend.key, exc)
            continue
        except BaseException:
            replica.inflight -= 1
            raise
        if isinstance(outcome, _Refused):
            replica.inflight -= 1
            up.metrics.upstream_errors.labels(model, str(outcome.status)).inc()
            up.metrics.retries.labels(model, str(outcome.status)).inc()
            last = outcome
            continue
        return Relay(model, outcome, functools.partial(_finished, up, model, replica))
    if last is not None:  # every replica refused: the client sees the last refusal as it was
        return Response(last.body, status_code=last.status, headers=last.headers)
    body = error_body(503, f"no replica of {model} is reachable", code="no_replica")
    return Unreachable(body, status_code=503)


class Unreachable(JSONResponse):
    """`forward`'s answer when no replica could be reached (none refused: none answered)."""


def unreachable(response: Response) -> bool:
    return isinstance(response, Unreachable)


def _finished(up: Upstream, model: str, replica: Replica, kind: str) -> None:
    replica.inflight -= 1
    if kind != "ok":
        up.metrics.upstream_errors.labels(model, kind).inc()


class UpstreamCut(Exception):
    """The replica's stream broke after the response was committed: the connection is closed
    without the final chunk, which is how HTTP/1.1 tells the client the body is incomplete."""


class Relay(Response):
    """Streams a committed upstream response: chunks as they arrive (no buffering), each send
    waiting for the client's socket (uvicorn's flow control is the backpressure), and the
    upstream closed when the client goes away."""

    def __init__(self, model: str, committed: _Committed, done: Callable[[str], None]) -> None:
        self.model, self.c, self.done = model, committed, done
        self.status_code = committed.response.status
        self.background = None
        headers = {k: v for k, v in committed.response.headers.items() if k.lower() in _PASS_BACK}
        length = committed.response.headers.get("Content-Length")
        # A whole body in the first chunk (a non-streamed answer) goes out with its length in
        # one send after the headers; anything else is relayed chunk by chunk.
        self.whole = length == str(len(committed.first))
        if length is not None and self.whole:
            headers["content-length"] = length
        headers["x-ember-replica"] = committed.replica.backend.key.rpartition("/")[2]
        self.init_headers(headers)

    async def _pump(self, send: Send) -> str:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        chunk = self.c.first
        if self.whole:
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
            return "ok"
        try:
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await anext(self.c.chunks, b"")
        except BEFORE_FIRST_BYTE as exc:  # here: after it
            log.warning(
                "%s: the stream from %s broke off: %r", self.model, self.c.replica.backend.key, exc
            )
            return "cut"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "ok"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = "client_gone"
        try:
            async with anyio.create_task_group() as group:

                async def pump() -> None:
                    nonlocal kind
                    try:
                        kind = await self._pump(send)
                    except OSError:  # the client's socket is gone (ASGI 2.4)
                        kind = "client_gone"
                    group.cancel_scope.cancel()

                group.start_soon(pump)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            if kind == "ok":
                self.c.response.release()  # read to the end: the connection goes back to the pool
            else:
                self.c.response.close()  # unread: the connection closes, the replica cancels
            self.done(kind)
        if kind == "cut":
            raise UpstreamCut("the replica's response broke off after the first byte")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[Response], receive: Receive) -> Response | None:
    """`work`'s result, or None once the client has gone (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its upstream is closed before we go on
    return None if task.cancelled() else task.result()
