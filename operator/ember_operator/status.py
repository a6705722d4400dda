"""Observed state → status: conditions, counts, per-replica state. Pure functions.

Conditions follow the Kubernetes conventions: one entry per type, `status` True/False/Unknown,
a CamelCase `reason`, a human `message`, `lastTransitionTime` that only moves when `status`
changes, and the `observedGeneration` the condition was computed for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import MODEL_DOWNLOAD_CONDITION
from ember_runtime.contract.rollout import parse_health_condition
from ember_runtime.contract.thermal import (
    REASON_POLICY_OFF,
    REASON_SENSOR_UNAVAILABLE,
    ThermalReading,
    parse_thermal_condition,
    report_joules,
)

from ember_operator.api.models import (
    Condition,
    InferenceDeploymentStatus,
    ReplicaStatus,
    RolloutStatus,
)
from ember_operator.render import REVISION_LABEL, SITE_SLICE_LABEL, Problem

READY, PROGRESSING, DEGRADED, THROTTLED = "Ready", "Progressing", "Degraded", "Throttled"
RECONCILING, STALLED = "Reconciling", "Stalled"  # kstatus's (`kstatus_conditions`)
THERMAL_FIELDS = ("temperatureCelsius", "maxBatchSize")
# Container waiting reasons that are part of every start. Any other one (CrashLoopBackOff,
# ImagePullBackOff, CreateContainerConfigError, …) is the kubelet saying the pod is stuck.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
MAX_MESSAGE = 512
# Top-level status fields that can go away (sent as null then): a rollout's record, and J/token
# once no replica has tokens in its last minute. The others are kept or always set.
REMOVABLE = frozenset({"rollout", "joulesPerToken"})


@dataclass(frozen=True)
class PodFailure:
    reason: str
    message: str


def _one_line(text: str) -> str:
    """Folded to one line; a long text keeps its end (a log tail's last line is the error)."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_MESSAGE else "…" + line[-(MAX_MESSAGE - 1) :]


def _terminated(cstatus: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container's failed termination, current or previous, if any. A container whose
    current run succeeded has no failure, whatever its previous run said (a prewarm that exited
    with ModelDownloading and then found the model completes; its lastState keeps the old
    exit for the pod's whole life)."""
    current = (cstatus.get("state") or {}).get("terminated")
    if current and current.get("exitCode", 0) == 0:
        return None
    for key in ("state", "lastState"):
        term = (cstatus.get(key) or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            return dict(term)
    return None


def _from_termination(
    name: str, term: Mapping[str, Any], limit: str | None
) -> tuple[PodFailure | None, str]:
    """(a failure with a reason of its own, or None; the termination's detail). Own reasons:
    the kubelet's OOMKilled, or a `Reason: detail` line prewarm or the runtime wrote
    (`ember_runtime.contract.reasons`)."""
    code = term.get("exitCode")
    if term.get("reason") == reasons.OOM_KILLED:
        detail = f"{name}: killed at its memory limit {limit or '(none set)'} (exit code {code})"
        return PodFailure(reasons.OOM_KILLED, detail), detail
    text = str(term.get("message") or "")
    parsed = reasons.parse_termination_message(text)
    if parsed is not None:
        return PodFailure(parsed[0], _one_line(parsed[1])), parsed[1]
    return None, _one_line(text or term.get("reason") or f"exit code {code}")


def _container_failure(
    cstatus: Mapping[str, Any], limit: str | None, *, init: bool
) -> PodFailure | None:
    name = str(cstatus.get("name"))
    waiting = (cstatus.get("state") or {}).get("waiting") or {}
    stuck = waiting.get("reason") not in (None, *STARTING_REASONS)
    term = _terminated(cstatus)
    if term is not None:
        own, detail = _from_termination(name, term, limit)
        if own is not None:
            return own
        if init:  # an init container that failed blocks the pod whatever its state now
            return PodFailure(reasons.PREWARM_FAILED, f"{name}: {detail}")
        if stuck:  # e.g. CrashLoopBackOff: the termination says more than "back-off 5m0s"
            return PodFailure(waiting["reason"], f"{name}: {detail}")
    if stuck:
        return PodFailure(waiting["reason"], _one_line(f"{name}: {waiting.get('message') or ''}"))
    return None


def _download_report(pod_status: Mapping[str, Any]) -> PodFailure | None:
    """ModelDownloading while prewarm runs and the node agent's live report on the pod says
    it waits (`ember.dev/ModelDownload`, written every 30 s; nodeagent/podprogress.py)."""
    running = any(
        c.get("name") == "prewarm" and "running" in (c.get("state") or {})
        for c in pod_status.get("initContainerStatuses") or []
    )
    if not running:
        return None
    for cond in pod_status.get("conditions") or []:
        if cond.get("type") == MODEL_DOWNLOAD_CONDITION and cond.get("status") == "True":
            return PodFailure(reasons.MODEL_DOWNLOADING, _one_line(str(cond.get("message") or "")))
    return None


def pod_failure(
    pod_status: Mapping[str, Any], memory_limits: Mapping[str, str] | None = None
) -> PodFailure | None:
    """The reason a pod cannot become ready by itself, if any (init failures first), with the
    kubelet's (or the container's own) message. `memory_limits`: container -> limit, for the
    OOMKilled message. A prewarm waiting for its model right now reports the agent's live
    figures, not an older exit of its own."""
    if (waiting := _download_report(pod_status)) is not None:
        return waiting
    limits = memory_limits or {}
    for cstatus in pod_status.get("initContainerStatuses") or []:
        failure = _container_failure(cstatus, limits.get(str(cstatus.get("name"))), init=True)
        if failure:
            return failure
    for cstatus in pod_status.get("containerStatuses") or []:
        if cstatus.get("ready"):
            continue
        failure = _container_failure(cstatus, limits.get(str(cstatus.get("name"))), init=False)
        if failure:
            return failure
    for cond in pod_status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == reasons.UNSCHEDULABLE:
            return PodFailure(reasons.UNSCHEDULABLE, _one_line(cond.get("message") or ""))
    return None


def _memory_limits(spec: Mapping[str, Any]) -> dict[str, str]:
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return {
        str(c.get("name")): str(limit)
        for c in containers
        if (limit := ((c.get("resources") or {}).get("limits") or {}).get("memory"))
    }


def pod_started(status: Mapping[str, Any]) -> bool:
    """Whether any container has run: its volumes were mounted and its sandbox is up, so a
    kubelet Event about those (FailedMount, …) is history."""
    for cstatus in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        state, last = cstatus.get("state") or {}, cstatus.get("lastState") or {}
        if "running" in state or "terminated" in state or "terminated" in last:
            return True
    return False


def pod_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """The little of a pod the status needs (what the pod index keeps in memory)."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    labels = meta.get("labels") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    failure = pod_failure(status, _memory_limits(spec))
    return {
        "pod": meta.get("name"),
        "node": spec.get("nodeName"),
        "phase": status.get("phase"),
        "ready": ready,
        "started": pod_started(status),
        "deleting": meta.get("deletionTimestamp") is not None,
        "failure": None
        if failure is None
        else {"reason": failure.reason, "message": failure.message},
        # The runtime's own report (ember.dev/Thermal), decoded here and nowhere else on the
        # operator's side; None before its first write, or when it is not a report at all.
        "thermal": parse_thermal_condition(status.get("conditions")),
        # Rollouts (spec.rollout): the site's Deployment and the revision the pod runs (from
        # the template the operator rendered), and the runtime's ember.dev/Health report.
        "site": labels.get(SITE_SLICE_LABEL),
        "revision": labels.get(REVISION_LABEL),
        "health": parse_health_condition(status.get("conditions")),
        # The runtime's LoRA adapters report (ember.dev/Adapters): served and refused names.
        "adapters": reasons.parse_adapters_condition(status.get("conditions")),
    }


def with_kubelet_events(
    pods: Iterable[Mapping[str, Any]], events: Mapping[str, PodFailure]
) -> list[Mapping[str, Any]]:
    """Pod summaries, where a pod that has not started any container and reports no failure of
    its own takes the kubelet's warning Event about it (`events`: pod name -> reason/message),
    e.g. FailedMount for a hostPath that does not exist: such a pod waits in ContainerCreating
    forever and its status says nothing else."""
    out: list[Mapping[str, Any]] = []
    for pod in pods:
        event = events.get(str(pod.get("pod")))
        if event is None or pod.get("failure") or pod.get("started"):
            out.append(pod)
        else:
            failure = {"reason": event.reason, "message": _one_line(event.message)}
            out.append({**pod, "failure": failure})
    return out


def _replica_fields(reading: ThermalReading) -> dict[str, Any]:
    """The report's values a replica's status row shows (the sensor problem goes to Throttled)."""
    out: dict[str, Any] = {}
    if reading.temperature_celsius is not None:
        out["temperatureCelsius"] = reading.temperature_celsius
    if reading.max_batch_size is not None:
        out["maxBatchSize"] = reading.max_batch_size
    if reading.joules_per_token is not None:
        out["joulesPerToken"] = reading.joules_per_token
    return out


@dataclass(frozen=True)
class Thermal:
    """The thermal aggregate of one object's replicas, as status values (`thermal_of`)."""

    replicas: Mapping[str, Mapping[str, Any]]  # pod -> {temperatureCelsius, maxBatchSize}
    hottest_celsius: int | None
    throttled: Mapping[str, Any]  # the Throttled condition, without times


def thermal_of(pods: Iterable[Mapping[str, Any]], adaptive: bool) -> Thermal:
    """Fold the replicas' own reports (pod summaries) into the object's thermal status. What
    each governor decided (its batch, its capacity, its reason) is taken as reported, never
    worked out again here, and the spec's maximum is not brought back up to compare with:
    `adaptive` (whether the spec asks for a policy at all) is the one spec value used."""
    live = sorted(
        (str(p["pod"]), p["thermal"]) for p in pods if not p.get("deleting") and p.get("thermal")
    )
    replicas = {pod: _replica_fields(reading) for pod, reading in live}
    temps = [r.temperature_celsius for _, r in live if r.temperature_celsius is not None]
    return Thermal(replicas, max(temps, default=None), _throttled(live, adaptive))


Report = tuple[str, ThermalReading]  # (pod, its decoded report)


def _full_batch(live: list[Report]) -> str:
    """The all-clear message, with the capacities the replicas report (two during a rollout
    that changes engine.maxBatchSize; none before the first report)."""
    sizes = sorted({r.capacity for _, r in live if r.capacity is not None})
    if not sizes:
        return "all replicas run at their max batch"
    return "all replicas run at max batch " + " or ".join(str(s) for s in sizes)


def _throttled(live: list[Report], adaptive: bool) -> dict[str, str]:
    if not adaptive or any(r.reason == REASON_POLICY_OFF for _, r in live):
        return {
            "type": THROTTLED,
            "status": "False",
            "reason": reasons.THERMAL_POLICY_OFF,
            "message": "thermal.policy is static (or off): no thermal batch control",
        }
    reduced = [(pod, r) for pod, r in live if r.reduced]
    if not reduced:
        blind = any(r.reason == REASON_SENSOR_UNAVAILABLE for _, r in live)
        message = _full_batch(live) + _sensor_problems(live)
        return {
            "type": THROTTLED,
            "status": "False",
            # Not throttled, but only because nothing is measured: `kubectl describe` says why.
            "reason": REASON_SENSOR_UNAVAILABLE if blind else reasons.FULL_BATCH,
            "message": message[:MAX_MESSAGE],
        }
    parts = [
        f"{pod} at {'?' if r.temperature_celsius is None else r.temperature_celsius} °C: "
        f"batch {r.max_batch_size}/{r.capacity}"
        for pod, r in reduced
    ]
    return {
        "type": THROTTLED,
        "status": "True",
        "reason": reasons.THERMAL_THROTTLING,
        "message": ("; ".join(parts) + _sensor_problems(live))[:MAX_MESSAGE],
    }


def _sensor_problems(live: list[Report]) -> str:
    """The message's tail for replicas whose sensor is broken ("; sensor problems: p-0: nvml:
    NVML cannot start ..."), so `kubectl describe infd` says why a replica has no temperature."""
    parts = [f"{pod}: {r.detail}" for pod, r in live if r.detail]
    return f"; sensor problems: {'; '.join(parts)}" if parts else ""


@dataclass(frozen=True)
class Observed:
    generation: int
    desired: int
    deployment: Mapping[str, Any] | None
    pods: list[Mapping[str, Any]]
    problems: list[Problem]
    selector: str
    # None: keep what status says (e.g. while the spec cannot be parsed).
    thermal: Thermal | None = None
    rollout: Mapping[str, Any] | None = None  # status.rollout (spec.rollout), as stepped


def _condition(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": ctype,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def _rollout(obs: Observed) -> tuple[int, int, bool]:
    """(pods, ready pods, rollout complete) from the Deployment's own status."""
    dep = obs.deployment
    if dep is None:
        return 0, 0, False
    st = dep.get("status") or {}
    generation = (dep.get("metadata") or {}).get("generation", 0)
    current = st.get("observedGeneration", 0) >= generation
    replicas, ready = st.get("replicas", 0), st.get("readyReplicas", 0)
    updated = st.get("updatedReplicas", 0)
    done = current and updated == obs.desired and replicas == obs.desired and ready >= obs.desired
    return replicas, ready, done


def conditions_for(obs: Observed) -> list[dict[str, Any]]:
    replicas, ready, done = _rollout(obs)
    counts = f"{ready}/{obs.desired} ready"
    failures = [p for p in obs.pods if p.get("failure") and not p.get("deleting")]
    if obs.problems:
        first = obs.problems[0]
        return [
            _condition(READY, False, first.reason, first.message),
            _condition(PROGRESSING, False, first.reason, "the spec cannot be served; fix it"),
            _condition(DEGRADED, True, first.reason, first.message),
        ]
    if obs.desired == 0:
        ready_c = _condition(READY, True, reasons.SCALED_TO_ZERO, "replicas is 0")
    elif ready >= obs.desired and obs.deployment is not None:
        ready_c = _condition(READY, True, reasons.ALL_REPLICAS_READY, counts)
    else:
        ready_c = _condition(READY, False, reasons.REPLICAS_NOT_READY, counts)
    if done:
        prog = _condition(
            PROGRESSING, False, reasons.ROLLOUT_COMPLETE, "all replicas are up to date"
        )
    else:
        prog = _condition(PROGRESSING, True, reasons.ROLLING_OUT, f"{replicas} pods, {ready} ready")
    degraded = _degraded(failures)
    if obs.rollout is not None:
        prog, degraded = _site_rollout(obs.rollout, prog, degraded)
    return [ready_c, prog, degraded]


def _site_rollout(
    rollout: Mapping[str, Any], prog: dict[str, Any], degraded: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Progressing and Degraded as a site-by-site rollout makes them (status.rollout)."""
    phase, summary = rollout.get("phase"), str(rollout.get("summary") or "")
    message = str(rollout.get("message") or summary)
    if phase == "Progressing":
        prog = _condition(PROGRESSING, True, reasons.ROLLING_OUT, f"site by site: {summary}")
    elif phase == "Paused":
        prog = _condition(PROGRESSING, True, reasons.ROLLOUT_PAUSED, f"paused: {summary}")
    elif phase == "Halted":
        prog = _condition(PROGRESSING, False, reasons.ROLLOUT_HALTED, message)
        degraded = _condition(DEGRADED, True, reasons.ROLLOUT_HALTED, message)
    elif phase == "RolledBack":
        prog = _condition(PROGRESSING, False, reasons.ROLLED_BACK, message)
        degraded = _condition(DEGRADED, True, reasons.ROLLED_BACK, message)
    return prog, degraded


def kstatus_conditions(conditions: list[dict[str, Any]], problems: bool) -> list[dict[str, Any]]:
    """kstatus's abnormal-true pair, which Flux, cli-utils and kpt read: Reconciling while a
    change is on its way, Stalled while it cannot go on without a person (a spec that cannot
    be served, a rollout halted or rolled back)."""
    by_type = {c["type"]: c for c in conditions}
    prog, degraded = by_type[PROGRESSING], by_type[DEGRADED]
    moving = prog["status"] == "True"
    stuck = problems or (
        degraded["status"] == "True"
        and degraded["reason"] in (reasons.ROLLOUT_HALTED, reasons.ROLLED_BACK)
    )
    if stuck:
        stalled = _condition(STALLED, True, degraded["reason"], degraded["message"])
    else:
        stalled = _condition(STALLED, False, reasons.AS_EXPECTED, "")
    reconciling = _condition(RECONCILING, moving, prog["reason"], prog["message"] if moving else "")
    return [reconciling, stalled]


def _degraded(failures: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Degraded from the pods' failures. A real failure comes first; replicas that only wait
    for their model make one ModelDownloading condition listing every waiting node's progress
    (prewarm's message: `node-a: 1.2 of 3.4 GB in the node cache, ETA 2m10s (…)`)."""
    if not failures:
        return _condition(DEGRADED, False, reasons.AS_EXPECTED, "")
    blocking = [p for p in failures if p["failure"]["reason"] != reasons.MODEL_DOWNLOADING]
    if blocking:
        first = blocking[0]
        message = f"pod {first['pod']}: {first['failure']['message']}"
        return _condition(DEGRADED, True, first["failure"]["reason"], message)
    return _condition(DEGRADED, True, reasons.MODEL_DOWNLOADING, downloading_message(failures))


def downloading_message(pods: Iterable[Mapping[str, Any]]) -> str:
    """One entry per node (its pods share the node's cache, so one says it for all), sorted,
    so the text changes only when a node's progress report does."""
    per_node: dict[str, str] = {}
    for pod in sorted(pods, key=lambda p: str(p.get("pod"))):
        node = str(pod.get("node") or f"pod {pod.get('pod')}")
        text = str(pod["failure"]["message"])
        # prewarm names its node; an older prewarm's message ("N of M bytes…") does not.
        per_node.setdefault(node, text if text.startswith(f"{node}: ") else f"{node}: {text}")
    parts = [per_node[n] for n in sorted(per_node)]
    noun = "node waits" if len(parts) == 1 else "nodes wait"
    message = f"{len(parts)} {noun} for the model: " + "; ".join(parts)
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


def _with_times(
    new: list[dict[str, Any]], old: Iterable[Mapping[str, Any]], now: str, generation: int
) -> list[dict[str, Any]]:
    previous = {c.get("type"): c for c in old}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same and before else now
        out.append({**cond, "lastTransitionTime": stamp or now, "observedGeneration": generation})
    return out


def _replica_statuses(
    pods: list[Mapping[str, Any]], old: Iterable[Mapping[str, Any]], thermal: Thermal | None
) -> list[ReplicaStatus]:
    """Per-pod rows; thermal fields from the pod's own condition, else (not reported yet) the
    last values status holds."""
    previous = {r.get("pod"): r for r in old}
    fresh = thermal.replicas if thermal else {}
    rows = []
    for pod in sorted(pods, key=lambda p: str(p.get("pod"))):
        if pod.get("deleting"):
            continue
        name = str(pod["pod"])
        last, now = previous.get(name, {}), fresh.get(name, {})
        values = {k: now.get(k, last.get(k)) for k in THERMAL_FIELDS}
        # J/token is not kept from an older report: a replica with no tokens in its last
        # minute has no figure, and its report says so.
        joules = now.get("joulesPerToken") if name in fresh else last.get("joulesPerToken")
        rows.append(
            ReplicaStatus(
                pod=name,
                node=pod.get("node") or None,
                phase=pod.get("phase") or None,
                temperature_celsius=values["temperatureCelsius"],
                max_batch_size=values["maxBatchSize"],
                joules_per_token=joules,
            )
        )
    return rows


def _mean_joules(rows: list[ReplicaStatus]) -> float | None:
    """status.joulesPerToken (J/Token in `kubectl get -o wide`): the replicas' mean."""
    figures = [r.joules_per_token for r in rows if r.joules_per_token is not None]
    return report_joules(sum(figures) / len(figures)) if figures else None


def _summary_reason(conditions: list[dict[str, Any]]) -> str:
    """STATUS in `kubectl get`: Degraded's reason, else Ready's, else Progressing's."""
    by_type = {c["type"]: c for c in conditions}
    for ctype, when in ((DEGRADED, "True"), (READY, "True")):
        if by_type[ctype]["status"] == when:
            return str(by_type[ctype]["reason"])
    return str(by_type[PROGRESSING]["reason"])


def adapters_ready(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The `AdaptersReady` condition from the replicas' own reports (`ember.dev/Adapters`):
    False with `AdapterRefused` naming each refused adapter and why (as its replicas say), else
    True; None while no live replica has reported (no adapters, or none started yet). Ready is
    not touched: a refused adapter leaves the base and the other adapters serving."""
    reports = [
        p["adapters"] for p in pods if not p.get("deleting") and p.get("adapters") is not None
    ]
    if not reports:
        return None
    refused: dict[str, set[str]] = {}
    for report in reports:
        for name, why in report.refused:
            refused.setdefault(name, set()).add(why)
    if refused:
        parts = [f"{name}: {' | '.join(sorted(whys))}" for name, whys in sorted(refused.items())]
        message = f"{len(refused)} adapter(s) refused: {'; '.join(parts)}"
        return _condition(
            reasons.ADAPTERS_READY, False, reasons.ADAPTER_REFUSED, message[:MAX_MESSAGE]
        )
    served = sorted({name for report in reports for name in report.served})
    message = f"{len(served)} adapter(s) served by {len(reports)} replica(s)"
    return _condition(reasons.ADAPTERS_READY, True, reasons.ADAPTERS_SERVED, message)


def build_status(obs: Observed, old: Mapping[str, Any], now: str) -> InferenceDeploymentStatus:
    """The whole status subresource for `obs`, typed, reusing transition times from `old`."""
    replicas, ready, _ = _rollout(obs)
    old_conditions = old.get("conditions") or []
    computed = conditions_for(obs)
    computed += kstatus_conditions(computed, bool(obs.problems))
    throttled = obs.thermal.throttled if obs.thermal else _find(old_conditions, THROTTLED)
    if throttled:
        computed.append({k: throttled.get(k, "") for k in ("type", "status", "reason", "message")})
    adapters = adapters_ready(obs.pods)
    if adapters is not None:
        computed.append(adapters)
    conditions = _with_times(computed, old_conditions, now, obs.generation)
    rows = _replica_statuses(obs.pods, old.get("replicaStatuses") or [], obs.thermal)
    hottest = obs.thermal.hottest_celsius if obs.thermal else None
    batches = [r.max_batch_size for r in rows if r.max_batch_size is not None]
    return InferenceDeploymentStatus(
        observed_generation=obs.generation,
        replicas=replicas,
        ready_replicas=ready,
        ready=f"{ready}/{obs.desired}",
        reason=_summary_reason(conditions),
        selector=obs.selector,
        conditions=[Condition.model_validate(c) for c in conditions],
        replica_statuses=rows,
        hottest_celsius=old.get("hottestCelsius") if hottest is None else hottest,
        # The tightest limit in force: what `kubectl get infd` shows as Batch.
        max_batch_size=min(batches, default=None),
        joules_per_token=_mean_joules(rows),
        rollout=None if obs.rollout is None else RolloutStatus.model_validate(obs.rollout),
    )


def to_wire(built: InferenceDeploymentStatus) -> dict[str, Any]:
    """The status as the API server takes it (camelCase; unset fields left out)."""
    return built.model_dump(mode="json", by_alias=True, exclude_none=True)


def _find(conditions: Iterable[Mapping[str, Any]], ctype: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


def changed_fields(new: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Only the top-level status fields that differ: the patch is empty in steady state. As a
    merge patch: a key that went away is sent as null (status.rollout's nested keys too), so
    the API server drops it rather than keeping the old value."""
    return {
        k: _merge_value(v, old.get(k))
        for k, v in _with_removed(new, old).items()
        if old.get(k) != v
    }


def _with_removed(new: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    gone = {k: None for k in old if k not in new and k in REMOVABLE}
    return {**gone, **new}


def _merge_value(new: Any, old: Any) -> Any:
    if isinstance(new, Mapping) and isinstance(old, Mapping):
        out = {k: _merge_value(v, old.get(k)) for k, v in new.items()}
        out.update({k: None for k in old if k not in new})
        return out
    return new
