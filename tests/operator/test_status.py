"""Observed state → status, as pure functions."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ember_operator import status
from ember_operator.render import Problem
from ember_operator.status_writer import PodEvents, worth_an_event
from ember_runtime.contract import reasons
from ember_runtime.prewarm.errors import ChecksumMismatch

from tests.operator.specs import deployment, wire_status

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _obs(**kw: Any) -> status.Observed:
    base: dict[str, Any] = {
        "generation": 5,
        "desired": 3,
        "deployment": deployment(3, 3),
        "pods": [],
        "problems": [],
        "selector": "a=b",
    }
    base.update(kw)
    return status.Observed(**base)


def _conds(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_all_ready() -> None:
    st = wire_status(_obs(), {}, NOW)
    assert _conds(st) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
        "Reconciling": ("False", "RolloutComplete"),
        "Stalled": ("False", "AsExpected"),
    }
    assert (st["ready"], st["readyReplicas"], st["observedGeneration"]) == ("3/3", 3, 5)
    assert all(c["observedGeneration"] == 5 for c in st["conditions"])


def test_rolling_out() -> None:
    st = wire_status(_obs(deployment=deployment(3, 1, updated=2)), {}, NOW)
    assert _conds(st)["Ready"] == ("False", "ReplicasNotReady")
    assert _conds(st)["Progressing"] == ("True", "RollingOut")
    assert _conds(st)["Reconciling"] == ("True", "RollingOut")  # kstatus: InProgress
    assert _conds(st)["Stalled"] == ("False", "AsExpected")
    assert st["reason"] == "RollingOut" and st["ready"] == "1/3"


SHA_WANT, SHA_GOT = "ab12" * 16, "9f3c" * 16


def _pod(status_: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p-1"}, "spec": spec or {"nodeName": "n1"}, "status": status_}


def _degraded(summary: dict[str, Any]) -> dict[str, Any]:
    st = wire_status(_obs(deployment=deployment(3, 2), pods=[summary]), {}, NOW)
    return next(c for c in st["conditions"] if c["type"] == "Degraded")


def test_prewarm_termination_message_degrades() -> None:
    # The line the prewarm container really writes (its own writer), as the kubelet reports it.
    message = ChecksumMismatch("gemma.gguf", SHA_WANT, SHA_GOT).termination_message()
    pod = _pod(
        {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "prewarm",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": message + "\n"}},
                }
            ],
        }
    )
    summary = status.pod_summary(pod)
    assert summary["failure"] == {
        "reason": "ChecksumMismatch",
        "message": "gemma.gguf expected ab12ab12ab12… got 9f3c9f3c9f3c…",
    }
    degraded = _degraded(summary)
    assert (degraded["status"], degraded["reason"]) == ("True", "ChecksumMismatch")
    assert degraded["message"] == "pod p-1: gemma.gguf expected ab12ab12ab12… got 9f3c9f3c9f3c…"


def test_every_node_side_reason_round_trips() -> None:
    for name, reason in reasons.REASONS.items():
        if reason.source in reasons.NODE_SIDE:
            line = reasons.termination_message(name, "a\nb")
            assert reasons.parse_termination_message(line) == (name, "a b")
    # Free text (an older image, a crash's log tail) is no reason, nor is an operator reason.
    assert reasons.parse_termination_message("checksum mismatch: a expected b") is None
    assert reasons.parse_termination_message("ValueError: boom") is None
    assert reasons.parse_termination_message("Unschedulable: x") is None


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
    assert status.pod_failure(crash) == status.PodFailure("ImagePullBackOff", "runtime: nope")
    assert status.pod_failure({"phase": "Running"}) is None


def test_every_waiting_reason_but_a_normal_start_degrades_with_the_kubelets_message() -> None:
    def waiting(reason: str, message: str, init: bool = False) -> dict[str, Any]:
        key = "initContainerStatuses" if init else "containerStatuses"
        state = {"waiting": {"reason": reason, "message": message}}
        return {key: [{"name": "prewarm" if init else "runtime", "state": state}]}

    msg = 'secret "api-key" not found'
    assert status.pod_failure(waiting("CreateContainerConfigError", msg)) == status.PodFailure(
        "CreateContainerConfigError", f"runtime: {msg}"
    )
    # The image is pulled for the init container first: its failure must show too.
    pull = 'Back-off pulling image "ember/runtime:typo"'
    assert status.pod_failure(waiting("ImagePullBackOff", pull, init=True)) == status.PodFailure(
        "ImagePullBackOff", f"prewarm: {pull}"
    )
    assert status.pod_failure(waiting("SomeFutureReason", "x")) == status.PodFailure(
        "SomeFutureReason", "runtime: x"
    )
    for normal in ("ContainerCreating", "PodInitializing"):
        assert status.pod_failure(waiting(normal, "")) is None
        assert status.pod_failure(waiting(normal, "", init=True)) is None


def test_oom_kill_names_the_memory_limit() -> None:
    spec = {"containers": [{"name": "runtime", "resources": {"limits": {"memory": "512Mi"}}}]}
    oom = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    crashing = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}
    pod = _pod(
        {"containerStatuses": [{"name": "runtime", "state": crashing, "lastState": oom}]}, spec
    )
    failure = status.pod_summary(pod)["failure"]
    assert failure == {
        "reason": "OOMKilled",
        "message": "runtime: killed at its memory limit 512Mi (exit code 137)",
    }
    # Restarted and serving again: an old OOM kill is history, not a degraded replica.
    running = {"name": "runtime", "ready": True, "state": {"running": {}}, "lastState": oom}
    assert status.pod_summary(_pod({"containerStatuses": [running]}, spec))["failure"] is None


def test_runtime_refusal_reason_wins_over_crashloop() -> None:
    line = reasons.termination_message(reasons.ENGINE_MEMORY_OVER_LIMIT, "memory: needs 814 MiB")
    cstatus = {
        "name": "runtime",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": 2, "message": line}},
    }
    assert status.pod_failure({"containerStatuses": [cstatus]}) == status.PodFailure(
        "EngineMemoryOverLimit", "memory: needs 814 MiB"
    )


def test_kubelet_event_degrades_a_pod_that_never_started() -> None:
    message = 'MountVolume.SetUp failed for volume "model" : hostPath type check failed'
    events = {"p-1": status.PodFailure("FailedMount", message)}
    creating = {"containerStatuses": [{"name": "runtime", "state": {"waiting": {}}}]}
    stuck = status.pod_summary(_pod({"phase": "Pending", **creating}))
    assert stuck["started"] is False
    (merged,) = status.with_kubelet_events([stuck], events)
    degraded = _degraded(dict(merged))
    assert (degraded["reason"], degraded["message"]) == ("FailedMount", f"pod p-1: {message}")
    # Once a container ran, the mount worked: the Event (kept for an hour) is history.
    running = {"containerStatuses": [{"name": "runtime", "state": {"running": {}}}]}
    started = status.pod_summary(_pod({"phase": "Running", **running}))
    assert status.with_kubelet_events([started], events) == [started]
    # The pod's own failure says more than an Event about it.
    pulling = {"name": "runtime", "state": {"waiting": {"reason": "ErrImagePull"}}}
    own = status.pod_summary(_pod({"containerStatuses": [pulling]}))
    (kept,) = status.with_kubelet_events([own], events)
    assert kept["failure"]["reason"] == "ErrImagePull"


def test_pod_events_store_keeps_the_specific_message() -> None:
    store = PodEvents()
    key = ("ns", "gemma")
    specific = status.PodFailure("FailedMount", "MountVolume.SetUp failed: not a directory")
    generic = status.PodFailure(
        "FailedMount", "Unable to attach or mount volumes: unmounted volumes=[model]: timed out"
    )
    assert store.record(key, "gemma-1-a", specific, "2026-01-01T00:00:00") is True
    assert store.record(key, "gemma-1-a", specific, "2026-01-01T00:00:09") is False  # repeat
    assert store.record(key, "gemma-1-a", generic, "2026-01-01T00:02:00") is False
    sandbox = status.PodFailure("FailedCreatePodSandBox", "cni: no IP")
    assert store.record(key, "gemma-1-a", sandbox, "2025-12-31T23:59:00") is False  # older
    assert store.of(key) == {"gemma-1-a": specific}
    store.forget(key, "gemma-1-a")
    assert store.of(key) == {}


def test_problem_blocks_ready() -> None:
    st = wire_status(_obs(problems=[Problem("SharedMemoryTooSmall", "too small")]), {}, NOW)
    assert _conds(st)["Degraded"] == ("True", "SharedMemoryTooSmall")
    assert _conds(st)["Ready"][0] == "False"
    assert _conds(st)["Stalled"] == ("True", "SharedMemoryTooSmall")  # kstatus: Failed


@pytest.mark.parametrize(
    ("phase", "progressing", "degraded", "reconciling", "stalled"),
    [
        ("Progressing", ("True", "RollingOut"), "False", "True", "False"),
        ("Paused", ("True", "RolloutPaused"), "False", "True", "False"),
        ("Halted", ("False", "RolloutHalted"), "True", "False", "True"),
        ("RolledBack", ("False", "RolledBack"), "True", "False", "True"),
        ("Complete", ("False", "RolloutComplete"), "False", "False", "False"),
    ],
)
def test_a_site_rollout_sets_the_conditions(
    phase: str, progressing: tuple[str, str], degraded: str, reconciling: str, stalled: str
) -> None:
    rollout = {"phase": phase, "summary": "canary 0/1 " + phase, "message": "site a failed"}
    st = wire_status(dataclasses.replace(_obs(), rollout=rollout), {}, NOW)
    conds = _conds(st)
    assert conds["Progressing"] == progressing
    assert conds["Degraded"][0] == degraded
    assert (conds["Reconciling"][0], conds["Stalled"][0]) == (reconciling, stalled)
    assert st["rollout"]["phase"] == phase


def test_a_rollout_key_that_goes_away_is_sent_as_null() -> None:
    old = {"rollout": {"phase": "Progressing", "currentWave": "canary", "waves": [1]}}
    new = {"rollout": {"phase": "Complete", "waves": [2]}}
    assert status.changed_fields(new, old) == {
        "rollout": {"phase": "Complete", "waves": [2], "currentWave": None}
    }
    assert status.changed_fields({}, old) == {"rollout": None}


def test_transition_time_only_moves_on_status_change() -> None:
    first = wire_status(_obs(deployment=deployment(3, 1)), {}, NOW)
    again = wire_status(_obs(deployment=deployment(3, 1)), first, LATER)
    assert again == first
    assert status.changed_fields(again, first) == {}
    ready = wire_status(_obs(), first, LATER)
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
    st = wire_status(_obs(pods=pods), old, NOW)
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
    st = wire_status(_obs(pods=PODS, thermal=thermal), {}, NOW)
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
    assert status.changed_fields(wire_status(_obs(pods=PODS, thermal=thermal), st, LATER), st) == {}


def test_no_thermal_tick_keeps_what_status_holds() -> None:
    thermal = status.Thermal(
        {"p-0": {"temperatureCelsius": 84, "maxBatchSize": 13}}, 84, _throttled(True)
    )
    before = wire_status(_obs(pods=PODS, thermal=thermal), {}, NOW)
    after = wire_status(_obs(pods=PODS), before, LATER)  # e.g. just restarted
    assert status.changed_fields(after, before) == {}


def test_cooling_flips_throttled_with_a_new_transition_time() -> None:
    hot = status.Thermal(
        {"p-0": {"temperatureCelsius": 84, "maxBatchSize": 13}}, 84, _throttled(True)
    )
    cool = status.Thermal(
        {"p-0": {"temperatureCelsius": 70, "maxBatchSize": 16}}, 70, _throttled(False)
    )
    before = wire_status(_obs(pods=PODS, thermal=hot), {}, NOW)
    after = wire_status(_obs(pods=PODS, thermal=cool), before, LATER)
    changed = status.changed_fields(after, before)
    assert set(changed) == {"conditions", "replicaStatuses", "hottestCelsius", "maxBatchSize"}
    assert changed["maxBatchSize"] == 16
    throttled = next(c for c in after["conditions"] if c["type"] == "Throttled")
    assert (throttled["status"], throttled["lastTransitionTime"]) == ("False", LATER)
    ready = next(c for c in after["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == NOW


def test_thermal_of_folds_the_replicas_own_conditions() -> None:
    from ember_runtime.contract.thermal import ThermalReading, thermal_condition

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
    thermal = status.thermal_of(pods, adaptive=True)
    assert thermal.hottest_celsius == 84
    assert thermal.replicas == {
        "a": {"temperatureCelsius": 84, "maxBatchSize": 13},
        "b": {"temperatureCelsius": 60, "maxBatchSize": 16},
    }
    assert thermal.throttled["status"] == "True"
    assert thermal.throttled["message"] == "a at 84 °C: batch 13/16"
    st = wire_status(_obs(pods=pods, thermal=thermal), {}, NOW)
    assert (st["hottestCelsius"], st["maxBatchSize"]) == (84, 13)
    off = status.thermal_of(pods, adaptive=False)
    assert off.throttled["reason"] == "ThermalPolicyOff"


def test_joules_per_token_per_replica_and_their_mean() -> None:
    """J/token from the replicas' own reports: per row, and the mean of those that have one
    (`kubectl get infd -o wide`); a replica whose newest report has none loses its figure."""
    from ember_runtime.contract.thermal import ThermalReading, thermal_condition

    def pod(name: str, joules: float | None) -> dict[str, Any]:
        reading = ThermalReading("Normal", 60, 16, 16, joules_per_token=joules)
        return _reporting_pod(name, thermal_condition(reading, NOW))

    pods = [pod("a", 0.42), pod("b", 0.5), pod("c", None)]
    thermal = status.thermal_of(pods, adaptive=True)
    assert thermal.replicas["a"] == {
        "temperatureCelsius": 60,
        "maxBatchSize": 16,
        "joulesPerToken": 0.42,
    }
    st = wire_status(_obs(pods=pods, thermal=thermal), {}, NOW)
    rows = {r["pod"]: r.get("joulesPerToken") for r in st["replicaStatuses"]}
    assert rows == {"a": 0.42, "b": 0.5, "c": None}
    assert st["joulesPerToken"] == 0.46  # (0.42 + 0.5) / 2, two significant digits
    # b's next report has no figure (no tokens for a minute): its row and the mean follow.
    pods = [pod("a", 0.42), pod("b", None), pod("c", None)]
    later = wire_status(_obs(pods=pods, thermal=status.thermal_of(pods, adaptive=True)), st, LATER)
    assert [r.get("joulesPerToken") for r in later["replicaStatuses"]] == [0.42, None, None]
    assert later["joulesPerToken"] == 0.42
    # No figure anywhere: the field goes, and so does the J/Token column's value.
    pods = [pod("a", None)]
    none = wire_status(
        _obs(pods=pods, thermal=status.thermal_of(pods, adaptive=True)), later, LATER
    )
    assert "joulesPerToken" not in none
    assert status.changed_fields(none, later)["joulesPerToken"] is None  # the patch drops it
    # No thermal tick (e.g. the operator just restarted): the rows keep what status holds.
    kept = wire_status(_obs(pods=[{"pod": "a", "phase": "Running"}]), st, LATER)
    assert kept["joulesPerToken"] == 0.42


def test_a_replica_without_a_sensor_says_why_in_throttled() -> None:
    """`kubectl describe infd` must answer "why is there no temperature?" (a GPU node whose
    runtime has no NVML): the replica's own report carries the cause up to the object."""
    from ember_runtime.contract.thermal import ThermalReading, thermal_condition

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
    thermal = status.thermal_of(pods, adaptive=True)
    assert thermal.throttled == {
        "type": "Throttled",
        "status": "False",
        "reason": "SensorUnavailable",
        "message": f"all replicas run at max batch 16; sensor problems: gpu-0: {why}",
    }
    assert thermal.replicas == {"gpu-0": {"maxBatchSize": 16}}  # no sensorProblem in replicas
    st = wire_status(_obs(pods=pods, thermal=thermal), {}, NOW)
    throttled = next(c for c in st["conditions"] if c["type"] == "Throttled")
    assert throttled["reason"] == "SensorUnavailable" and why in throttled["message"]


def _reporting_pod(name: str, condition: dict[str, Any]) -> dict[str, Any]:
    body = {
        "metadata": {"name": name},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "conditions": [condition]},
    }
    return status.pod_summary(body)


def test_the_pod_index_keeps_the_decoded_report_and_drops_a_forged_one() -> None:
    """Decoded once, in the pod summary the index keeps; a report that is not one (a sentence
    alone, or data that contradicts its condition) counts as no report."""
    from ember_runtime.contract.thermal import ThermalReading, thermal_condition

    reading = ThermalReading("Throttled", 84, 13, 16)
    good = thermal_condition(reading, NOW)
    assert _reporting_pod("a", good)["thermal"] == reading
    forged = [
        {**good, "message": "99 °C, batch 1/16"},
        {**good, "reason": "Critical"},
        {**good, "message": good["message"].replace('"maxBatchSize":13', '"maxBatchSize":99')},
    ]
    pods = [_reporting_pod(f"f{i}", cond) for i, cond in enumerate(forged)]
    assert [p["thermal"] for p in pods] == [None, None, None]
    thermal = status.thermal_of(pods, adaptive=True)
    assert (thermal.replicas, thermal.hottest_celsius) == ({}, None)


def test_throttled_is_what_each_governor_decided_not_the_spec() -> None:
    """A replica runs 13 of its engine's 16 while the spec already says 32 (a rollout under
    way): the report's own batch and capacity tell, not the spec's maximum."""
    from ember_runtime.contract.thermal import ThermalReading, thermal_condition

    old = _reporting_pod("old", thermal_condition(ThermalReading("Throttled", 84, 13, 16), NOW))
    full = _reporting_pod("new", thermal_condition(ThermalReading("Normal", 60, 32, 32), NOW))
    thermal = status.thermal_of([old, full], adaptive=True)
    assert thermal.throttled["status"] == "True"
    assert thermal.throttled["message"] == "old at 84 °C: batch 13/16"
    cool = _reporting_pod("old", thermal_condition(ThermalReading("Normal", 60, 16, 16), NOW))
    assert status.thermal_of([cool, full], adaptive=True).throttled["status"] == ("False")


def _waiting_pod(pod: str, node: str, message: str, state: str = "running") -> dict[str, Any]:
    """A replica whose prewarm exited with ModelDownloading and now runs (or waits) again."""
    line = reasons.termination_message(reasons.MODEL_DOWNLOADING, message)
    current: dict[str, Any] = {"running": {}} if state == "running" else {}
    if state == "completed":
        current = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    body = {
        "metadata": {"name": pod},
        "spec": {"nodeName": node},
        "status": {
            "phase": "Running" if state == "completed" else "Pending",
            "initContainerStatuses": [
                {
                    "name": "prewarm",
                    "state": current,
                    "lastState": {"terminated": {"exitCode": 1, "message": line + "\n"}},
                }
            ],
        },
    }
    return status.pod_summary(body)


def test_model_downloading_lists_every_waiting_node_once() -> None:
    """Two nodes wait (two pods on node-b share its cache and say the same): one Degraded
    condition, reason ModelDownloading (the STATUS column), one entry per node, sorted."""
    pods = [
        _waiting_pod("p-3", "node-b", "node-b: 0.4 of 3.4 GB in the node cache, ETA unknown"),
        _waiting_pod("p-1", "node-a", "node-a: 1.2 of 3.4 GB in the node cache, ETA 2m10s"),
        _waiting_pod("p-2", "node-b", "node-b: 0.5 of 3.4 GB in the node cache, ETA 9m00s"),
    ]
    st = wire_status(_obs(deployment=deployment(3, 0), pods=pods), {}, NOW)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert st["reason"] == "ModelDownloading"
    assert degraded["message"] == (
        "2 nodes wait for the model: node-a: 1.2 of 3.4 GB in the node cache, ETA 2m10s; "
        "node-b: 0.5 of 3.4 GB in the node cache, ETA 9m00s"
    )


def test_an_older_prewarms_message_gets_its_node_and_a_real_failure_wins() -> None:
    waiting = _waiting_pod("p-1", "node-a", "1000 of 3000 bytes in the node cache after 1800s")
    assert status.downloading_message([waiting]) == (
        "1 node waits for the model: node-a: 1000 of 3000 bytes in the node cache after 1800s"
    )
    broken = _pod(
        {"containerStatuses": [{"name": "runtime", "state": {"waiting": {"reason": "X"}}}]}
    )
    degraded = _degraded_of([waiting, status.pod_summary(broken)])
    assert degraded["reason"] == "X"


def _degraded_of(pods: list[dict[str, Any]]) -> dict[str, Any]:
    st = wire_status(_obs(deployment=deployment(3, 0), pods=pods), {}, NOW)
    return next(c for c in st["conditions"] if c["type"] == "Degraded")


def test_a_prewarm_that_completed_after_waiting_is_no_failure() -> None:
    """lastState keeps the ModelDownloading exit for the pod's life; a completed prewarm
    clears it (else a ready replica would stay Degraded for ever)."""
    done = _waiting_pod("p-1", "node-a", "node-a: 1 of 2 GB", state="completed")
    assert done["failure"] is None
    waiting = _waiting_pod("p-1", "node-a", "node-a: 1 of 2 GB", state="backoff")
    assert waiting["failure"]["reason"] == "ModelDownloading"


def test_one_event_per_new_progress_report_not_per_refresh() -> None:
    def cond(reason: str, message: str, ok: str = "True") -> dict[str, Any]:
        return {"type": "Degraded", "status": ok, "reason": reason, "message": message}

    first = cond("ModelDownloading", "1 node waits for the model: a: 1 of 3 GB, ETA 1m")
    assert worth_an_event(first, [cond("AsExpected", "", "False")])
    assert not worth_an_event(first, [first])  # a refresh with the same report
    newer = cond("ModelDownloading", "1 node waits for the model: a: 2 of 3 GB, ETA 30s")
    assert not worth_an_event(newer, [first])  # live figures every 30 s: the condition has them
    other = cond("ChecksumMismatch", "pod p: x")
    assert not worth_an_event(cond("ChecksumMismatch", "pod q: y"), [other])  # reason only
    assert not worth_an_event(cond("AsExpected", "", "False"), [first])


def test_a_running_prewarm_shows_the_agents_live_download_report() -> None:
    """The node agent's `ember.dev/ModelDownload` condition is the pod's ModelDownloading while
    prewarm runs, ahead of an older ModelDownloading exit in prewarm's lastState; once prewarm
    is done, or the condition is False, it is nothing."""
    old_exit = {
        "terminated": {
            "exitCode": 1,
            "message": "ModelDownloading: node-a: 0.1 of 3.4 GB in the node cache, ETA unknown",
        }
    }
    live = "node-a: 1.2 of 3.4 GB in the node cache, ETA 3m03s (12.0 MB/s over 1m40s)"
    pod = {
        "phase": "Pending",
        "initContainerStatuses": [
            {"name": "prewarm", "state": {"running": {}}, "lastState": old_exit}
        ],
        "conditions": [
            {"type": "ember.dev/ModelDownload", "status": "True", "message": live},
        ],
    }
    assert status.pod_failure(pod) == status.PodFailure(reasons.MODEL_DOWNLOADING, live)
    summary = status.pod_summary(
        {"metadata": {"name": "p"}, "spec": {"nodeName": "node-a"}, "status": pod}
    )
    assert status.downloading_message([summary]) == f"1 node waits for the model: {live}"
    cached = {**pod, "conditions": [{"type": "ember.dev/ModelDownload", "status": "False"}]}
    assert (
        status.pod_failure(
            {**cached, "initContainerStatuses": [{"name": "prewarm", "state": {"running": {}}}]}
        )
        is None
    )
    finished = {"name": "prewarm", "state": {"terminated": {"exitCode": 0}}}
    assert status.pod_failure({**pod, "initContainerStatuses": [finished]}) is None
