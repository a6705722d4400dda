"""The replica's own health over a recent window, kept as its Pod's `ember.dev/Health` condition.

Every finished request of the OpenAI endpoints (`TRACKED`, streamed or not) is one record:
when it finished, whether the server failed it, its time to first token, and whether the thermal
governor held the batch below capacity while it ran. What is counted:

- a response with a 4xx status (validation, auth, a full queue) is the client's: not counted;
- so is a request whose client left before its response ended (nginx's 499);
- a 5xx, an exception, or an engine error or timeout after a streamed 200 is a server error;
- TTFT is the value the `ember_time_to_first_token_seconds` histogram observes
  (`generation.Generation`: from admission to the first generated token; the first choice's for
  several); a response with no generated token (embeddings) counts the time to its response.
  Only unthrottled requests' TTFTs enter the p99 (under heat it is not the version's).

Memory is bounded: counts live in `BUCKETS` time buckets (exact counts, the window's edge
within `window_seconds / BUCKETS`), TTFTs in the newest `MAX_TTFT_SAMPLES`.

The condition goes through `reporter.CoalescingReporter` (the thermal condition's
writer): the first report, then only a change of reason or errors, of the throttled flag or of
having a TTFT at all, a request count in another doubling band (`requests_band`), or a TTFT p99
more than 10 % away from the last written one; at most one write per `MIN_INTERVAL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember_runtime.contract.rollout import MAX_COUNT, MAX_MS, HealthReport, health_condition
from ember_runtime.reporter import CoalescingReporter, ConditionWriter

DEFAULT_WINDOW_SECONDS = 300
BUCKETS = 300
MAX_TTFT_SAMPLES = 2048
MIN_INTERVAL_SECONDS = 10.0  # at most one write per pod per 10 s
TICK_SECONDS = 1.0  # how often the window is re-read (it ages with no request too)
TTFT_CHANGE = 0.10
TRACKED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
_SERVER_FAILURES = frozenset({"error", "timeout"})  # a generation's end that is the server's
_PROBE = "ember_health"  # the per-request probe's key in the ASGI scope's state


@dataclass(slots=True)
class RequestHealth:
    """One request on its way: filled by `HealthRecorder` and `generation.Generation`."""

    started: float  # the tracker's clock
    status: int | None = None
    responded: float | None = None  # seconds from `started` to the response's start
    generating: bool = False  # a `Generation` serves it (its TTFT is a token's, or none)
    ttft: float | None = None  # seconds to the first generated token, as the histogram has it
    failed: bool = False  # the server failed it after its status went out
    client_left: bool = False

    def first_token(self, seconds: float) -> None:
        if self.ttft is None or seconds < self.ttft:
            self.ttft = seconds

    def ended(self, finish_reason: str | None) -> None:
        """One choice's end; an engine error or a timeout fails the request."""
        if finish_reason in _SERVER_FAILURES:
            self.failed = True


def probe_of(request: Request) -> RequestHealth | None:
    probe = getattr(request.state, _PROBE, None)
    return probe if isinstance(probe, RequestHealth) else None


@dataclass(slots=True)
class _Bucket:
    start: float
    requests: int = 0
    errors: int = 0
    throttled: bool = False


class HealthTracker:
    """The last `window_seconds` of finished requests, and the governor's heat as it goes."""

    def __init__(
        self,
        window_seconds: int = DEFAULT_WINDOW_SECONDS,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_seconds = window_seconds
        self.clock = clock
        self._width = window_seconds / BUCKETS
        self._buckets: deque[_Bucket] = deque()
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=MAX_TTFT_SAMPLES)
        self._reduced = False
        self._reduced_until = float("-inf")  # the last time the batch was known reduced

    def heat(self, reduced: bool) -> None:
        """One governor decision: is the batch held below the engine's capacity now."""
        if reduced or self._reduced:  # reduced until now, at least
            self._reduced_until = self.clock()
        self._reduced = reduced

    def throttled_since(self, started: float) -> bool:
        return self._reduced or self._reduced_until >= started

    def record(self, *, ok: bool, ttft: float | None, throttled: bool) -> None:
        now = self.clock()
        if not self._buckets or now >= self._buckets[-1].start + self._width:
            self._buckets.append(_Bucket(math.floor(now / self._width) * self._width))
        bucket = self._buckets[-1]
        bucket.requests += 1
        bucket.errors += not ok
        bucket.throttled = bucket.throttled or throttled
        if ttft is not None and not throttled:
            self._ttfts.append((now, ttft))

    def finish(self, probe: RequestHealth) -> None:
        """A request's end, as `HealthRecorder` saw it; a client's doing is not counted."""
        status = 500 if probe.status is None else probe.status
        if probe.client_left or 400 <= status < 500:
            return
        ok = status < 500 and not probe.failed
        ttft = probe.ttft if probe.generating or not ok else probe.responded
        self.record(ok=ok, ttft=ttft, throttled=self.throttled_since(probe.started))

    def _prune(self) -> None:
        since = self.clock() - self.window_seconds
        while self._buckets and self._buckets[0].start < since:
            self._buckets.popleft()
        while self._ttfts and self._ttfts[0][0] < since:
            self._ttfts.popleft()

    def report(self) -> HealthReport:
        self._prune()
        requests = sum(b.requests for b in self._buckets)
        errors = sum(b.errors for b in self._buckets)
        return HealthReport(
            requests=min(requests, MAX_COUNT),
            errors=min(errors, MAX_COUNT),
            ttft_p99_ms=p99_ms([seconds for _, seconds in self._ttfts]),
            throttled=any(b.throttled for b in self._buckets),
            window_seconds=self.window_seconds,
        )


def p99_ms(seconds: list[float]) -> int | None:
    """The nearest-rank 99th percentile in whole milliseconds (None for no sample)."""
    if not seconds:
        return None
    rank = math.ceil(0.99 * len(seconds)) - 1
    return min(MAX_MS, round(sorted(seconds)[rank] * 1000))


# ----------------------------------------------------------------------------- the condition


def requests_band(requests: int) -> int:
    """0 for none, then 1, 2-3, 4-7, 8-15, ...: an idle pod that gets busy reports at once, a
    steady one only when its count doubles or halves."""
    return requests.bit_length()


def worth_reporting(last: HealthReport | None, new: HealthReport) -> bool:
    if last is None:
        return True
    if (last.reason, last.errors, last.throttled) != (new.reason, new.errors, new.throttled):
        return True
    if requests_band(last.requests) != requests_band(new.requests):
        return True
    return _ttft_moved(last.ttft_p99_ms, new.ttft_p99_ms)


def _ttft_moved(last: int | None, new: int | None) -> bool:
    if last is None or new is None:
        return last != new
    return abs(new - last) > TTFT_CHANGE * last


def health_reporter(
    writer: ConditionWriter,
    *,
    min_interval: float = MIN_INTERVAL_SECONDS,
    clock: Callable[[], float] = time.monotonic,
) -> CoalescingReporter[HealthReport]:
    return CoalescingReporter(
        writer,
        worth=worth_reporting,
        condition=health_condition,
        what="health",
        min_interval=min_interval,
        clock=clock,
    )


async def report_forever(
    tracker: HealthTracker,
    reporter: CoalescingReporter[HealthReport],
    every: float = TICK_SECONDS,
) -> None:
    """Until cancelled: offer the window's report every `every` s (it ages with no request)."""
    while True:
        reporter.offer(tracker.report())
        await asyncio.sleep(every)


# ----------------------------------------------------------------------------- the middleware


class HealthRecorder:
    """Pure ASGI (no buffering of SSE): one `RequestHealth` per request to `TRACKED`, left in the
    scope's state for the route, given to the tracker when the response ends."""

    def __init__(self, app: ASGIApp, tracker: HealthTracker) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in TRACKED:
            await self.app(scope, receive, send)
            return
        probe = RequestHealth(self.tracker.clock())
        scope.setdefault("state", {})[_PROBE] = probe
        exchange = _Exchange(probe, receive, send, self.tracker.clock)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except ClientDisconnect:
            raise  # the client's doing: not counted
        except Exception:
            probe.failed = True
            self.tracker.finish(probe)
            raise
        self.tracker.finish(probe)


class _Exchange:
    """Watches one request's ASGI messages: its status, and whether its client left before the
    response ended (a disconnect after it is the connection's normal end)."""

    def __init__(
        self, probe: RequestHealth, receive: Receive, send: Send, clock: Callable[[], float]
    ) -> None:
        self._probe, self._receive, self._send, self._clock = probe, receive, send, clock
        self._done = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self._done:
            self._probe.client_left = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._probe.status = int(message["status"])
            self._probe.responded = self._clock() - self._probe.started
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self._done = True
        await self._send(message)
