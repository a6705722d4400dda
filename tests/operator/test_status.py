"""Observed state → status, as pure functions."""

from __future__ import annotations

from typing import Any

from ember_operator import status
from ember_operator.render import Problem

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _dep(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        },
    }


def _obs(**kw: Any) -> status.Observed:
    base: dict[str, Any] = {
        "generation": 5,
        "desired": 3,
        "deployment": _dep(3, 3),
        "pods": [],
        "problems": [],
        "selector": "a=b",
    }
    base.update(kw)
    return status.Observed(**base)


def _conds(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_all_ready() -> None:
    st = status.compute_status(_obs(), {}, NOW)
    assert _conds(st) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (st["ready"], st["readyReplicas"], st["observedGeneration"]) == ("3/3", 3, 5)
    assert all(c["observedGeneration"] == 5 for c in st["conditions"])


def test_rolling_out() -> None:
    st = status.compute_status(_obs(deployment=_dep(3, 1, updated=2)), {}, NOW)
    assert _conds(st)["Ready"] == ("False", "ReplicasNotReady")
    assert _conds(st)["Progressing"] == ("True", "RollingOut")
    assert st["reason"] == "RollingOut" and st["ready"] == "1/3"


def test_init_container_termination_message_degrades() -> None:
    pod = {
        "metadata": {"name": "p-1"},
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "prewarm",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 3,
                            "message": "ChecksumMismatch: gemma.gguf has sha256 abc, want def",
                        }
                    },
                }
            ],
        },
    }
    summary = status.pod_summary(pod)
    assert summary["failure"] == {
        "reason": "ChecksumMismatch",
        "message": "gemma.gguf has sha256 abc, want def",
    }
    st = status.compute_status(_obs(deployment=_dep(3, 2), pods=[summary]), {}, NOW)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChecksumMismatch")
    assert "p-1" in degraded["message"] and st["reason"] == "ChecksumMismatch"


def test_unprefixed_failure_and_crashloop() -> None:
    init_fail = {
        "initContainerStatuses": [
            {"name": "prewarm", "state": {"terminated": {"exitCode": 1, "message": "boom"}}}
        ]
    }
    assert status.pod_failure(init_fail) == status.PodFailure("PrewarmFailed", "prewarm: boom")
    crash = {
        "containerStatuses": [
            {
                "name": "runtime",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "nope"}},
            }
        ]
    }
    failure = status.pod_failure(crash)
    assert failure is not None and failure.reason == "ImagePullBackOff"
    assert status.pod_failure({"phase": "Running"}) is None


def test_problem_blocks_ready() -> None:
    st = status.compute_status(
        _obs(problems=[Problem("SharedMemoryTooSmall", "too small")]), {}, NOW
    )
    assert _conds(st)["Degraded"] == ("True", "SharedMemoryTooSmall")
    assert _conds(st)["Ready"][0] == "False"


def test_transition_time_only_moves_on_status_change() -> None:
    first = status.compute_status(_obs(deployment=_dep(3, 1)), {}, NOW)
    again = status.compute_status(_obs(deployment=_dep(3, 1)), first, LATER)
    assert again == first
    assert status.changed_fields(again, first) == {}
    ready = status.compute_status(_obs(), first, LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["Ready"] == LATER and times["Degraded"] == NOW
    assert set(status.changed_fields(ready, first)) == {
        "readyReplicas",
        "ready",
        "reason",
        "conditions",
    }


def test_thermal_fields_of_replicas_are_kept() -> None:
    pods = [
        {"pod": "b", "node": "n2", "phase": "Running"},
        {"pod": "a", "node": "n1", "phase": "Running"},
    ]
    old = {"replicaStatuses": [{"pod": "a", "temperatureCelsius": 80.5, "maxBatchSize": 4}]}
    st = status.compute_status(_obs(pods=pods), old, NOW)
    assert st["replicaStatuses"] == [
        {
            "pod": "a",
            "node": "n1",
            "phase": "Running",
            "temperatureCelsius": 80.5,
            "maxBatchSize": 4,
        },
        {"pod": "b", "node": "n2", "phase": "Running"},
    ]


def _throttled(on: bool) -> dict[str, str]:
    reason = "ThermalThrottling" if on else "FullBatch"
    return {
        "type": "Throttled",
        "status": "True" if on else "False",
        "reason": reason,
        "message": "",
    }


PODS = [{"pod": "p-0", "node": "n1", "phase": "Running"}, {"pod": "p-1", "phase": "Running"}]


def test_thermal_report_fills_rows_hottest_and_condition() -> None:
    thermal = status.Thermal(
        {"p-0": {"temperatureCelsius": 84, "maxBatchSize": 13}}, 84, _throttled(True)
    )
    st = status.compute_status(_obs(pods=PODS, thermal=thermal), {}, NOW)
    assert st["replicaStatuses"] == [
        {
            "pod": "p-0",
            "node": "n1",
            "phase": "Running",
            "temperatureCelsius": 84,
            "maxBatchSize": 13,
        },
        {"pod": "p-1", "phase": "Running"},
    ]
    assert st["hottestCelsius"] == 84
    assert st["maxBatchSize"] == 13  # the tightest limit across replicas (p-1 has none yet)
    assert _conds(st)["Throttled"] == ("True", "ThermalThrottling")
    # Same inputs again: nothing changes, not even a timestamp (steady state writes nothing).
    assert (
        status.changed_fields(
            status.compute_status(_obs(pods=PODS, thermal=thermal), st, LATER), st
        )
        == {}
    )


def test_no_thermal_tick_keeps_what_status_holds() -> None:
    thermal = status.Thermal(
        {"p-0": {"temperatureCelsius": 84, "maxBatchSize": 13}}, 84, _throttled(True)
    )
    before = status.compute_status(_obs(pods=PODS, thermal=thermal), {}, NOW)
    after = status.compute_status(_obs(pods=PODS), before, LATER)  # e.g. just restarted
    assert status.changed_fields(after, before) == {}


def test_cooling_flips_throttled_with_a_new_transition_time() -> None:
    hot = status.Thermal(
        {"p-0": {"temperatureCelsius": 84, "maxBatchSize": 13}}, 84, _throttled(True)
    )
    cool = status.Thermal(
        {"p-0": {"temperatureCelsius": 70, "maxBatchSize": 16}}, 70, _throttled(False)
    )
    before = status.compute_status(_obs(pods=PODS, thermal=hot), {}, NOW)
    after = status.compute_status(_obs(pods=PODS, thermal=cool), before, LATER)
    changed = status.changed_fields(after, before)
    assert set(changed) == {"conditions", "replicaStatuses", "hottestCelsius", "maxBatchSize"}
    assert changed["maxBatchSize"] == 16
    throttled = next(c for c in after["conditions"] if c["type"] == "Throttled")
    assert (throttled["status"], throttled["lastTransitionTime"]) == ("False", LATER)
    ready = next(c for c in after["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == NOW


def test_thermal_of_folds_the_replicas_own_conditions() -> None:
    from ember_runtime.config import ThermalReading, thermal_condition

    def pod(name: str, reading: ThermalReading | None) -> dict[str, Any]:
        conditions = [{"type": "Ready", "status": "True"}]
        if reading is not None:
            conditions.append(thermal_condition(reading, NOW))
        body = {
            "metadata": {"name": name},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Running", "conditions": conditions},
        }
        return status.pod_summary(body)

    pods = [
        pod("a", ThermalReading("Throttled", 84, 13, 16)),
        pod("b", ThermalReading("Normal", 60, 16, 16)),
        pod("c", None),  # not reported yet
    ]
    thermal = status.thermal_of(pods, adaptive=True, max_batch=16)
    assert thermal.hottest_celsius == 84
    assert thermal.replicas == {
        "a": {"temperatureCelsius": 84, "maxBatchSize": 13},
        "b": {"temperatureCelsius": 60, "maxBatchSize": 16},
    }
    assert thermal.throttled["status"] == "True"
    assert thermal.throttled["message"] == "a at 84 °C: batch 13/16"
    st = status.compute_status(_obs(pods=pods, thermal=thermal), {}, NOW)
    assert (st["hottestCelsius"], st["maxBatchSize"]) == (84, 13)
    off = status.thermal_of(pods, adaptive=False, max_batch=16)
    assert off.throttled["reason"] == "ThermalPolicyOff"


def test_a_replica_without_a_sensor_says_why_in_throttled() -> None:
    """`kubectl describe infd` must answer "why is there no temperature?" (a GPU node whose
    runtime has no NVML): the replica's own report carries the cause up to the object."""
    from ember_runtime.config import ThermalReading, thermal_condition

    why = "nvml: NVML cannot start (no NVIDIA driver?): NVML Shared Library Not Found"
    body = {
        "metadata": {"name": "gpu-0"},
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "conditions": [
                thermal_condition(ThermalReading("SensorUnavailable", None, 16, 16, why), NOW)
            ],
        },
    }
    pods = [status.pod_summary(body)]
    thermal = status.thermal_of(pods, adaptive=True, max_batch=16)
    assert thermal.throttled == {
        "type": "Throttled",
        "status": "False",
        "reason": "SensorUnavailable",
        "message": f"all replicas run at max batch 16; sensor problems: gpu-0: {why}",
    }
    assert thermal.replicas == {"gpu-0": {"maxBatchSize": 16}}  # no sensorProblem in replicas
    st = status.compute_status(_obs(pods=pods, thermal=thermal), {}, NOW)
    throttled = next(c for c in st["conditions"] if c["type"] == "Throttled")
    assert throttled["reason"] == "SensorUnavailable" and why in throttled["message"]
