"""The runtime's health tracker and its condition's write rule, without a model: an injected clock,
the real tracker, the real coalescing reporter with a writer that records."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ember_runtime.contract.rollout import (
    HEALTH_CONDITION,
    HealthReport,
    parse_health_condition,
)
from ember_runtime.server.health import (
    BUCKETS,
    MAX_TTFT_SAMPLES,
    HealthTracker,
    RequestHealth,
    health_reporter,
    p99_ms,
    requests_band,
    worth_reporting,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker(window: int = 300) -> tuple[HealthTracker, Clock]:
    clock = Clock()
    return HealthTracker(window, clock=clock), clock


def finished(
    t: HealthTracker,
    status: int,
    *,
    ttft: float | None = None,
    generating: bool = True,
    failed: bool = False,
    client_left: bool = False,
    responded: float = 0.5,
) -> None:
    """One request through `finish`, as `HealthRecorder` hands it over."""
    probe = RequestHealth(t.clock(), status=status, responded=responded, generating=generating)
    probe.ttft, probe.failed, probe.client_left = ttft, failed, client_left
    t.finish(probe)


def test_an_idle_tracker_reports_idle() -> None:
    t, _ = tracker()
    assert t.report() == HealthReport(
        requests=0, errors=0, ttft_p99_ms=None, throttled=False, window_seconds=300
    )
    assert t.report().reason == "Idle"


def test_client_errors_and_clients_that_left_are_not_counted() -> None:
    t, _ = tracker()
    for status in (400, 401, 404, 413, 422, 429):
        finished(t, status)
    finished(t, 200, ttft=0.1, client_left=True)  # nginx's 499: the client's doing
    assert t.report().requests == 0
    finished(t, 200, ttft=0.1)
    finished(t, 500)
    finished(t, 504)
    finished(t, 200, ttft=0.2, failed=True)  # an engine error after the 200 went out
    report = t.report()
    assert (report.requests, report.errors, report.reason) == (4, 3, "ServerErrors")


def test_no_status_at_all_is_a_server_error() -> None:
    t, _ = tracker()
    t.finish(RequestHealth(t.clock(), failed=True))  # the app raised before answering
    assert (t.report().requests, t.report().errors) == (1, 1)


def test_ttft_is_the_first_tokens_or_the_responses_when_nothing_is_generated() -> None:
    t, _ = tracker()
    finished(t, 200, ttft=0.25, responded=0.01)  # streamed: headers go out before any token
    assert t.report().ttft_p99_ms == 250
    t2, _ = tracker()
    finished(t2, 200, generating=False, responded=0.04)  # embeddings: time to the response
    assert t2.report().ttft_p99_ms == 40
    t3, _ = tracker()
    finished(t3, 500, generating=False, responded=0.001)  # a failure's answer is no TTFT
    finished(t3, 200, ttft=None)  # generating, but no token came
    assert t3.report().ttft_p99_ms is None


def test_first_token_of_several_choices_is_the_earliest() -> None:
    probe = RequestHealth(0.0)
    for seconds in (0.3, 0.1, 0.2):
        probe.first_token(seconds)
    assert probe.ttft == 0.1
    probe.ended("stop")
    assert not probe.failed
    probe.ended("cancelled")  # the client left, or the server stopped it: the status says
    assert not probe.failed
    probe.ended("timeout")
    assert probe.failed


def test_p99_is_nearest_rank_in_whole_ms() -> None:
    assert p99_ms([]) is None
    assert p99_ms([0.1]) == 100
    samples = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert p99_ms(samples) == 99
    assert p99_ms([*samples, 5.0]) == 100  # 101 samples: rank 100
    assert p99_ms([7200.0]) == 3_600_000  # clamped to what the contract carries


def test_window_forgets_what_is_older() -> None:
    t, clock = tracker(window=60)
    finished(t, 500)
    clock.now += 30
    finished(t, 200, ttft=2.0)
    clock.now += 29
    assert (t.report().requests, t.report().errors) == (2, 1)
    clock.now += 1 + 60 / BUCKETS  # the error's bucket is out
    report = t.report()
    assert (report.requests, report.errors, report.ttft_p99_ms) == (1, 0, 2000)
    clock.now += 30
    assert t.report() == HealthReport(
        requests=0, errors=0, ttft_p99_ms=None, throttled=False, window_seconds=60
    )


def test_ttft_samples_are_bounded_counts_are_not() -> None:
    t, clock = tracker()
    for i in range(MAX_TTFT_SAMPLES + 500):
        clock.now += 0.01
        finished(t, 200, ttft=10.0 if i < 500 else 0.1)  # the slow ones are the oldest
    report = t.report()
    assert report.requests == MAX_TTFT_SAMPLES + 500
    assert report.ttft_p99_ms == 100  # only the newest MAX_TTFT_SAMPLES are kept


def test_throttled_requests_flag_the_window_and_leave_the_p99() -> None:
    t, clock = tracker(window=60)
    finished(t, 200, ttft=0.1)
    t.heat(reduced=True)  # the governor holds the batch below capacity
    finished(t, 200, ttft=9.0)
    clock.now += 1
    t.heat(reduced=False)
    report = t.report()
    assert report.throttled and report.requests == 2
    assert report.ttft_p99_ms == 100  # the hot request's TTFT is not the version's
    clock.now += 61
    assert not t.report().throttled  # aged out with it


def test_a_request_that_ran_while_the_batch_was_reduced_is_throttled() -> None:
    t, clock = tracker()
    t.heat(reduced=True)
    probe = RequestHealth(clock(), status=200, ttft=3.0, generating=True)
    clock.now += 0.5
    t.heat(reduced=False)  # cooled while it ran: it was throttled for part of it
    clock.now += 0.5
    t.finish(probe)
    assert t.report().throttled and t.report().ttft_p99_ms is None
    clock.now += 400
    later = RequestHealth(clock(), status=200, ttft=0.2, generating=True)
    clock.now += 0.5
    t.finish(later)  # started after the heat ended
    assert not t.report().throttled and t.report().ttft_p99_ms == 200


@pytest.mark.parametrize(
    ("n", "band"), [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (1000, 10)]
)
def test_requests_band_doubles(n: int, band: int) -> None:
    assert requests_band(n) == band


def report(
    requests: int = 100,
    errors: int = 0,
    ttft: int | None = 200,
    throttled: bool = False,
) -> HealthReport:
    return HealthReport(
        requests=requests,
        errors=errors,
        ttft_p99_ms=ttft,
        throttled=throttled,
        window_seconds=300,
    )


@pytest.mark.parametrize(
    ("last", "new", "worth"),
    [
        (None, report(), True),  # the first, always (replaces a predecessor's)
        (report(), report(), False),
        (report(requests=0, ttft=None), report(requests=1), True),  # idle -> busy: at once
        (report(requests=64), report(requests=127), False),  # same band
        (report(requests=127), report(requests=128), True),  # doubled
        (report(requests=64), report(requests=63), True),  # halved
        (report(errors=0), report(errors=1), True),  # reason Serving -> ServerErrors
        (report(errors=1), report(errors=2), True),
        (report(errors=2), report(errors=1), True),
        (report(ttft=200), report(ttft=220), False),  # 10 %: not more than 10 %
        (report(ttft=200), report(ttft=221), True),
        (report(ttft=200), report(ttft=179), True),
        (report(ttft=200), report(ttft=None), True),
        (report(ttft=None), report(ttft=5), True),
        (report(), report(throttled=True), True),  # the TTFT is read differently
    ],
)
def test_worth_reporting(last: HealthReport | None, new: HealthReport, worth: bool) -> None:
    assert worth_reporting(last, new) is worth


class Recorder:
    def __init__(self) -> None:
        self.conditions: list[dict[str, Any]] = []
        self.fail = False

    async def write(self, condition: dict[str, Any]) -> None:
        if self.fail:
            raise ConnectionError("API server away")
        self.conditions.append(condition)


async def test_reporter_writes_the_first_then_changes_only_coalesced() -> None:
    rec = Recorder()
    rep = health_reporter(rec, min_interval=0.3)
    task = asyncio.create_task(rep.run())
    try:
        rep.offer(report(requests=0, ttft=None))
        await asyncio.sleep(0.05)
        for n in (1, 2, 3, 5):  # a burst inside one interval: only the newest is written
            rep.offer(report(requests=n))
        await asyncio.sleep(0.5)
        for n in (4, 6, 7):  # same band, same TTFT: nothing to write
            rep.offer(report(requests=n))
        await asyncio.sleep(0.5)
    finally:
        task.cancel()
    written = [parse_health_condition([c]) for c in rec.conditions]
    assert written == [report(requests=0, ttft=None), report(requests=5)]
    first, second = rec.conditions
    assert first["type"] == HEALTH_CONDITION and first["reason"] == "Idle"
    assert second["status"] == "True" and second["reason"] == "Serving"
    assert second["lastTransitionTime"] == first["lastTransitionTime"]  # status did not flip


async def test_reporter_retries_and_writes_the_newest_not_a_backlog() -> None:
    rec = Recorder()
    rep = health_reporter(rec, min_interval=0.0)
    task = asyncio.create_task(rep.run())
    try:
        rec.fail = True
        rep.offer(report(errors=1))
        await asyncio.sleep(0.2)
        rep.offer(report(errors=3))
        await asyncio.sleep(0.2)
        rec.fail = False
        await asyncio.sleep(1.2)  # within one backoff (0.5 s, then 1 s) of the return
    finally:
        task.cancel()
    assert [parse_health_condition([c]) for c in rec.conditions] == [report(errors=3)]
    assert rec.conditions[0]["status"] == "False"
    assert rep.pending is None and rep.failures >= 1


def test_the_window_is_a_server_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_runtime.server.settings import load_settings

    monkeypatch.delenv("EMBER_CONFIG", raising=False)
    monkeypatch.delenv("EMBER_HEALTH_WINDOW_SECONDS", raising=False)
    model = ["--model", "/models/m.gguf"]
    assert load_settings(model).health_window_seconds == 300
    monkeypatch.setenv("EMBER_HEALTH_WINDOW_SECONDS", "120")
    assert load_settings(model).health_window_seconds == 120
    assert load_settings([*model, "--health-window-seconds", "60"]).health_window_seconds == 60
    with pytest.raises(ValueError, match="health_window_seconds"):
        load_settings([*model, "--health-window-seconds", "0"])
