"""The runtime's governor and condition reporter, without a cluster: injected clocks, a writer
that records or fails, the real policy."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.thermal import ThermalPolicy, ThermalReading, decode_report
from ember_runtime.reporter import ConditionReporter, worth_reporting
from ember_runtime.thermal.governor import Governor

POLICY = ThermalPolicy(min_batch_size=4, throttle_celsius=78)  # on engines of 16, below


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(clock: Clock | None = None, capacity: int = 16) -> tuple[Governor, list[int]]:
    pushed: list[int] = []
    gov = Governor(POLICY.limits(capacity), pushed.append, clock or Clock())
    return gov, pushed


def test_each_sample_sets_the_limit_and_only_changes_reach_the_engine() -> None:
    gov, pushed = governor()
    assert pushed == [16]  # the initial limit
    for temp in (60.0, 84.0, 84.0, 86.0, 74.0):
        gov.apply(temp)
    assert pushed == [16, 13, 12, 16]
    state = gov.apply(91.0)
    assert (state.batch, state.reason, state.shedding) == (4, "Critical", True)


def test_the_ladder_sheds_at_critical_and_stops_below_its_hysteresis() -> None:
    """Batch first (78..90 °C), then at 90 the floor and shedding to peers, which holds down to
    87 °C (critical − hysteresis) so one cooler sample does not pull work straight back; below
    that the batch takes over again, growing only as far as a reading 3 °C hotter allows."""
    gov, pushed = governor()
    steps = [(84.0, 13, False), (90.0, 4, True), (88.0, 4, True), (86.9, 11, False)]
    for temp, batch, shedding in steps:
        state = gov.apply(temp)
        assert (state.batch, state.shedding) == (batch, shedding), temp
        assert (state.reason == "Critical") == shedding
    assert gov.apply(80.0).batch == 14  # then the batch climbs back with its own hysteresis
    assert gov.apply(70.0).batch == 16
    assert pushed == [16, 13, 4, 11, 14, 16]


def test_a_broken_sensor_is_sensor_unavailable_not_just_no_reading() -> None:
    gov, _ = governor()
    why = "nvml: NVML cannot start (no NVIDIA driver?)"
    state = gov.apply(None, why)
    assert (state.batch, state.reason) == (16, "SensorUnavailable")  # full batch, and why
    assert state.reading().detail == why
    assert gov.set_override(8, 60).reason == "SensorUnavailable"  # kept across re-applies
    assert gov.apply(None).reason == "NoReading"  # nothing configured is broken
    # Another sensor still reads: the policy's own reason, the problem still reported.
    state = gov.apply(84.0, why)
    assert (state.reason, state.reading().detail) == ("Throttled", why)


def test_policy_max_is_capped_by_the_engine_capacity() -> None:
    gov, pushed = governor(capacity=8)
    assert pushed == [8]
    assert gov.apply(84.0).batch == 5  # 8 - 3 steps
    assert gov.state().capacity == 8


def test_override_wins_until_it_expires() -> None:
    clock = Clock()
    gov, pushed = governor(clock)
    gov.set_override(2, seconds=30)
    assert gov.apply(60.0).batch == 2
    clock.now = 29.9
    assert gov.apply(84.0).override is not None
    clock.now = 30.0
    state = gov.apply(84.0)
    assert (state.batch, state.override) == (13, None)
    assert pushed == [16, 2, 13]
    with pytest.raises(ValueError, match=r"within 1\.\.16"):
        gov.set_override(17, seconds=30)
    with pytest.raises(ValueError, match="expiresInSeconds"):
        gov.set_override(4, seconds=0)


def test_an_override_never_lifts_the_batch_above_the_policy() -> None:
    """Issue 34, hole 4: an override sheds load; it cannot switch thermal protection off.
    Before, a pinned 16 held at a critical 91 °C (the policy says 4, its floor) for as long as
    asked."""
    gov, pushed = governor()
    gov.set_override(16, seconds=86_400)
    state = gov.apply(91.0)
    assert (state.batch, state.reason) == (4, "Critical")
    assert state.override is not None  # still in force: it may lower the limit again
    assert gov.set_override(2, seconds=60).batch == 2
    gov.set_override(16, seconds=60)
    assert gov.apply(60.0).batch == 16  # cool again: the policy allows the full batch
    assert pushed == [16, 4, 2, 4, 16]


def test_reloaded_policy_applies_at_once_to_the_last_reading() -> None:
    gov, pushed = governor()
    gov.apply(80.0)
    assert pushed[-1] == 15
    state = gov.set_policy(POLICY.model_copy(update={"throttle_celsius": 70.0}))
    assert state.batch == 11  # 80 °C is five 2 °C steps above 70


@pytest.mark.parametrize(
    ("last", "new", "report"),
    [
        (None, ThermalReading("Normal", 50, 16, 16), True),  # the first, always
        (ThermalReading("Normal", 50, 16, 16), ThermalReading("Normal", 51, 16, 16), False),
        (ThermalReading("Normal", 50, 16, 16), ThermalReading("Normal", 52, 16, 16), True),
        (ThermalReading("Normal", 50, 16, 16), ThermalReading("Normal", 48, 16, 16), True),
        (ThermalReading("Throttled", 84, 13, 16), ThermalReading("Throttled", 84, 12, 16), True),
        (ThermalReading("Throttled", 84, 13, 16), ThermalReading("Critical", 84, 13, 16), True),
        (ThermalReading("Normal", 50, 16, 16), ThermalReading("NoReading", None, 16, 16), True),
        (  # the sensor's problem changed (e.g. driver gone → GPU lost): write it
            ThermalReading("SensorUnavailable", None, 16, 16, detail="nvml: no driver"),
            ThermalReading("SensorUnavailable", None, 16, 16, detail="nvml: GPU is lost"),
            True,
        ),
    ],
)
def test_worth_reporting(last: ThermalReading | None, new: ThermalReading, report: bool) -> None:
    assert worth_reporting(last, new, band=2.0) is report


class Recorder:
    def __init__(self) -> None:
        self.conditions: list[dict[str, Any]] = []
        self.fail = False
        self.attempts = 0

    async def write(self, condition: dict[str, Any]) -> None:
        self.attempts += 1
        if self.fail:
            raise ConnectionError("API server away")
        self.conditions.append(condition)


async def test_reporter_coalesces_newest_wins_and_is_quiet_when_nothing_changes() -> None:
    rec = Recorder()
    rep = ConditionReporter(rec, band_celsius=2.0, min_interval=0.3)
    task = asyncio.create_task(rep.run())
    try:
        rep.offer(ThermalReading("Normal", 60, 16, 16))
        await asyncio.sleep(0.05)
        for batch in (15, 14, 13):  # a burst inside one interval: only the newest is written
            rep.offer(ThermalReading("Throttled", 84, batch, 16))
        await asyncio.sleep(0.5)
        for _ in range(20):
            rep.offer(ThermalReading("Throttled", 84, 13, 16))  # unchanged: nothing to write
        await asyncio.sleep(0.5)
    finally:
        task.cancel()
    assert [decode_report(c["message"]).message() for c in rec.conditions] == [
        "60 °C, batch 16/16",
        "84 °C, batch 13/16",
    ]
    assert rec.conditions[1]["status"] == "True" and rec.conditions[1]["reason"] == "Throttled"
    assert rep.writes == 2


async def test_reporter_retries_with_capped_backoff_and_flushes_the_newest() -> None:
    rec = Recorder()
    rep = ConditionReporter(
        rec, band_celsius=2.0, min_interval=0.0, backoff_initial=0.05, backoff_cap=0.2
    )
    task = asyncio.create_task(rep.run())
    try:
        rec.fail = True
        rep.offer(ThermalReading("Throttled", 84, 13, 16))
        await asyncio.sleep(0.3)
        rep.offer(ThermalReading("Critical", 92, 6, 16))  # newer state while away
        await asyncio.sleep(0.7)
        failed = rec.attempts
        assert 4 <= failed <= 10  # 0.05, 0.1, 0.2, 0.2, ... : capped, not hammering
        rec.fail = False
        await asyncio.sleep(0.35)  # within one capped backoff of the return
    finally:
        task.cancel()
    assert [decode_report(c["message"]).message() for c in rec.conditions] == ["92 °C, batch 6/16"]
    assert rep.pending is None


async def test_transition_time_moves_only_when_status_flips() -> None:
    rec = Recorder()
    rep = ConditionReporter(rec, band_celsius=2.0, min_interval=0.0)
    task = asyncio.create_task(rep.run())
    try:
        rep.offer(ThermalReading("Throttled", 84, 13, 16))
        await asyncio.sleep(0.05)
        rep._since = "2020-01-01T00:00:00Z"  # as if written long ago
        rep.offer(ThermalReading("Throttled", 86, 12, 16))
        await asyncio.sleep(0.05)
        rep.offer(ThermalReading("Normal", 70, 16, 16))
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    times = [c["lastTransitionTime"] for c in rec.conditions]
    assert times[1] == "2020-01-01T00:00:00Z" and times[2] != times[1]


def test_node_agent_classifies_the_hottest_sensor() -> None:
    from ember_runtime.nodeagent.__main__ import node_reading

    assert node_reading(POLICY, {"a": 60.0, "b": 76.0}) == ThermalReading("Throttled", 76)
    assert node_reading(POLICY, {"a": 74.9}).reason == "Normal"  # below throttle − hysteresis
    assert node_reading(POLICY, {"a": 90.0}).reason == "Critical"
    assert node_reading(POLICY, {}) == ThermalReading("NoReading", None)


def test_no_api_access_means_no_reporter_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from ember_runtime.contract.config import RuntimeConfig, SensorConfig
    from ember_runtime.server.app import pod_reporters

    config = RuntimeConfig(
        model_name="m", model_dir="/m", sensors=SensorConfig(report_condition=True)
    )
    monkeypatch.setenv("POD_NAME", "p")
    monkeypatch.setenv("POD_NAMESPACE", "ns")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert pod_reporters(config, None, None) == (None, None)  # not in a pod
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("EMBER_SERVICEACCOUNT_DIR", str(tmp_path))
    assert pod_reporters(config, None, None) == (None, None)  # no token mounted
    (tmp_path / "token").write_text("t")
    (tmp_path / "ca.crt").write_text("not a certificate")
    assert pod_reporters(config, None, None) == (None, None)  # a broken CA: still serving
    (tmp_path / "ca.crt").write_text(
        Path(ssl.get_default_verify_paths().openssl_cafile).read_text()
    )
    reporter, healthy = pod_reporters(config, None, None)
    assert reporter is not None and reporter.band_celsius == 2.0 and healthy is not None
