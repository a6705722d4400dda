"""The InferenceDeployment's status as fleet engines read it: kstatus and Argo CD.

kstatus (sigs.k8s.io/cli-utils, what kpt, Config Sync and Flux-style waiters use) through the
Go harness tests/fleet/kstatus/, Argo CD through charts/ember/files/argocd-health.lua in a Lua
5.1 VM with Argo CD's libraries (tests/fleet/health.py). The mapping both must follow:

  the operator's status                    kstatus      Argo CD
  Ready, nothing rolling out               Current      Healthy
  a change rolling out (Reconciling)       InProgress   Progressing
  stalled: bad spec, halted, rolled back   Failed       Degraded
  paused site rollout                      InProgress   Suspended
  generation not observed yet              InProgress   Progressing

Statuses come from the operator's own code (`ember_operator.status.build_status`) and, for
rollout phases and edge cases, from objects written by hand. Where the engines disagree by
design (kstatus cannot tell a crash-looping pod from a slow one; it does not look at each
condition's observedGeneration; an object with no status at all is Current to it), the case
says so and pins what each says.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from ember_operator import status
from ember_operator.render import Problem
from ember_runtime.contract.cache import MODEL_DOWNLOAD_CONDITION

from tests.fleet import kstatus
from tests.fleet.health import (
    ARGOCD_CM,
    ARGOCD_HEALTH,
    ARGOCD_KEY,
    argo_health,
    check_object,
    check_objects,
)
from tests.operator.specs import deployment, wire_status

NOW = "2026-01-01T00:00:00Z"
GEN = 5
KSTATUS_CONDITIONS = ("Reconciling", "Stalled")


def infd(st: dict[str, Any] | None, generation: int = GEN, **meta: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "chat", "namespace": "default", "generation": generation, **meta},
        "spec": {"replicas": 3},
    }
    if st is not None:
        obj["status"] = st
    return obj


# ------------------------------------------------------------------ the operator's own status


def _pod(pod_status: dict[str, Any]) -> dict[str, Any]:
    return status.pod_summary(
        {"metadata": {"name": "chat-0"}, "spec": {"nodeName": "n1"}, "status": pod_status}
    )


CRASHING = {
    "phase": "Running",
    "containerStatuses": [
        {
            "name": "runtime",
            "ready": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
            "lastState": {"terminated": {"exitCode": 1, "message": "ValueError: boom"}},
        }
    ],
}
DOWNLOADING = {
    "phase": "Pending",
    "initContainerStatuses": [{"name": "prewarm", "state": {"running": {}}}],
    "conditions": [
        {
            "type": MODEL_DOWNLOAD_CONDITION,
            "status": "True",
            "message": "n1: 1.2 of 3.4 GB in the node cache, ETA 2m10s",
        }
    ],
}
THROTTLED = status.Thermal(
    replicas={},
    hottest_celsius=91,
    throttled={
        "type": "Throttled",
        "status": "True",
        "reason": "ThermalThrottling",
        "message": "chat-0 at 91 °C: batch 2/8",
    },
)


@dataclass(frozen=True)
class OperatorCase:
    id: str
    observed: dict[str, Any]  # Observed's fields over the defaults (3 replicas, all ready)
    conditions: dict[str, str]  # Ready/Progressing/Degraded: the status each must have
    kstatus: str  # with the operator's Reconciling/Stalled
    argo: str
    # What kstatus says from Ready alone, were Reconciling/Stalled missing: the gap they close.
    kstatus_without: str
    reconciling: bool | None = None  # None: either is right
    stalled: bool = False
    argo_message: str | None = None


OPERATOR_CASES = [
    OperatorCase(
        "all-ready",
        {},
        {"Ready": "True", "Progressing": "False", "Degraded": "False"},
        "Current",
        "Healthy",
        "Current",
        reconciling=False,
    ),
    OperatorCase(
        "scaled-to-zero",
        {"desired": 0, "deployment": deployment(0, 0)},
        {"Ready": "True", "Progressing": "False", "Degraded": "False"},
        "Current",
        "Healthy",
        "Current",
        reconciling=False,
    ),
    OperatorCase(
        "throttled-but-serving",
        {"thermal": THROTTLED},
        {"Ready": "True", "Progressing": "False", "Degraded": "False", "Throttled": "True"},
        "Current",
        "Healthy",
        "Current",
        reconciling=False,
    ),
    OperatorCase(
        "no-deployment-yet",
        {"deployment": None},
        {"Ready": "False", "Progressing": "True", "Degraded": "False"},
        "InProgress",
        "Progressing",
        "InProgress",
        reconciling=True,
    ),
    OperatorCase(
        "rolling-out",
        {"deployment": deployment(3, 1, updated=2)},
        {"Ready": "False", "Progressing": "True", "Degraded": "False"},
        "InProgress",
        "Progressing",
        "InProgress",
        reconciling=True,
    ),
    OperatorCase(
        # All replicas ready (the surge pod too) but one still runs the old template: only
        # Reconciling tells kstatus that this is not done.
        "rolling-out-all-ready",
        {"deployment": deployment(3, 3, updated=2)},
        {"Ready": "True", "Progressing": "True", "Degraded": "False"},
        "InProgress",
        "Progressing",
        "Current",
        reconciling=True,
    ),
    OperatorCase(
        "spec-cannot-be-served",
        {"problems": [Problem("InvalidSpec", "spec.model.files[0]: no such file")]},
        {"Ready": "False", "Progressing": "False", "Degraded": "True"},
        "Failed",
        "Degraded",
        "InProgress",
        reconciling=False,
        stalled=True,
        argo_message="spec.model.files[0]: no such file",
    ),
    OperatorCase(
        # Broken for Argo CD; for kstatus the kubelet still retries, so it waits (no Stalled).
        "pod-crash-looping",
        {"deployment": deployment(3, 2), "pods": [_pod(CRASHING)]},
        {"Ready": "False", "Progressing": "True", "Degraded": "True"},
        "InProgress",
        "Degraded",
        "InProgress",
        argo_message="pod chat-0: runtime: ValueError: boom",
    ),
    OperatorCase(
        # Degraded=True (ModelDownloading) is slow, not broken: both engines say it moves.
        "model-downloading",
        {"deployment": deployment(3, 0), "pods": [_pod(DOWNLOADING)]},
        {"Ready": "False", "Progressing": "True", "Degraded": "True"},
        "InProgress",
        "Progressing",
        "InProgress",
    ),
]


def _observed(overrides: dict[str, Any]) -> status.Observed:
    base: dict[str, Any] = {
        "generation": GEN,
        "desired": 3,
        "deployment": deployment(3, 3),
        "pods": [],
        "problems": [],
        "selector": "app=chat",
    }
    return status.Observed(**{**base, **overrides})


def _by_type(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st.get("conditions") or []}


def _without_kstatus_conditions(obj: dict[str, Any]) -> dict[str, Any]:
    st = dict(obj["status"])
    st["conditions"] = [c for c in st["conditions"] if c["type"] not in KSTATUS_CONDITIONS]
    return {**obj, "status": st}


def _check_kstatus_conditions(case: OperatorCase, conds: dict[str, dict[str, Any]]) -> bool:
    """Asserts Reconciling/Stalled where the operator writes them; False where it writes
    neither (then kstatus can only read Ready)."""
    present = [t for t in KSTATUS_CONDITIONS if t in conds]
    if not present:
        return False
    assert present == list(KSTATUS_CONDITIONS), f"only {present} written: kstatus needs both"
    if case.reconciling is not None:
        assert conds["Reconciling"]["status"] == str(case.reconciling), conds["Reconciling"]
    assert conds["Stalled"]["status"] == str(case.stalled), conds["Stalled"]
    for ctype in KSTATUS_CONDITIONS:
        assert conds[ctype]["observedGeneration"] == GEN
        if conds[ctype]["status"] == "True":
            assert conds[ctype]["reason"] and conds[ctype]["message"], conds[ctype]
    return True


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=lambda c: c.id)
def test_operator_status(case: OperatorCase) -> None:
    st = wire_status(_observed(case.observed), {}, NOW)
    conds = _by_type(st)
    assert st["observedGeneration"] == GEN
    assert all(c["observedGeneration"] == GEN for c in conds.values())
    assert {t: conds[t]["status"] for t in case.conditions} == case.conditions
    obj = infd(st)
    has_kstatus = _check_kstatus_conditions(case, conds)
    if not has_kstatus:
        warnings.warn(
            f"{case.id}: the operator writes no Reconciling/Stalled; kstatus reads Ready alone "
            f"and says {case.kstatus_without} (with them: {case.kstatus})",
            stacklevel=1,
        )
    (ks, argo), (ks_without, argo_without) = check_objects([obj, _without_kstatus_conditions(obj)])
    assert ks == (case.kstatus if has_kstatus else case.kstatus_without)
    assert ks_without == case.kstatus_without  # what the pair adds, pinned
    assert argo == argo_without == case.argo  # Argo CD's verdict never needs the pair
    if case.argo_message is not None:
        assert argo_health(obj)["message"] == case.argo_message


@pytest.mark.parametrize("case", OPERATOR_CASES[:3], ids=lambda c: c.id)
def test_operator_status_before_the_operator_sees_the_new_generation(
    case: OperatorCase,
) -> None:
    """The spec changed (generation 6) and the operator has not written for it yet."""
    st = wire_status(_observed(case.observed), {}, NOW)
    assert check_object(infd(st, generation=GEN + 1)) == ("InProgress", "Progressing")


ROLLOUTS = {
    "Progressing": {"phase": "Progressing", "summary": "wave 2/3 regional: 4/9 sites"},
    "Paused": {"phase": "Paused", "summary": "wave 2/3 regional: 4/9 sites"},
    "Halted": {
        "phase": "Halted",
        "summary": "halted in wave regional",
        "message": "site berlin-3 unreachable for 600 s (onUnreachable: Halt)",
    },
    "RolledBack": {
        "phase": "RolledBack",
        "summary": "rolled back",
        "message": "site berlin-3 failed its gate: 4.1% server errors (baseline 0.2%)",
    },
    "Complete": {"phase": "Complete", "summary": "9/9 sites on the new revision"},
}
ROLLOUT_EXPECTED = {
    "Progressing": ("InProgress", "Progressing"),
    "Paused": ("InProgress", "Suspended"),
    "Halted": ("Failed", "Degraded"),
    "RolledBack": ("Failed", "Degraded"),
    "Complete": ("Current", "Healthy"),
}


@pytest.mark.parametrize("phase", sorted(ROLLOUTS))
def test_operator_status_with_a_site_rollout(phase: str) -> None:
    """The operator's own conditions for each status.rollout phase (its Observed.rollout)."""
    if "rollout" not in {f.name for f in dataclasses.fields(status.Observed)}:
        pytest.skip("ember_operator.status.Observed has no rollout field (no site rollouts)")
    st = wire_status(_observed({"rollout": ROLLOUTS[phase]}), {}, NOW)
    assert st["rollout"]["phase"] == phase
    ks, argo = check_object(infd(st))
    want_ks, want_argo = ROLLOUT_EXPECTED[phase]
    assert argo == want_argo
    conds = _by_type(st)
    if all(t in conds for t in KSTATUS_CONDITIONS):
        assert ks == want_ks
        stalled = phase in ("Halted", "RolledBack")
        assert conds["Stalled"]["status"] == str(stalled)
        assert conds["Reconciling"]["status"] == str(phase in ("Progressing", "Paused"))
    else:  # every replica is Ready here: from Ready alone kstatus says Current
        assert ks == "Current"
        warnings.warn(
            f"rollout {phase}: no Reconciling/Stalled, kstatus says Current", stacklevel=1
        )


# ------------------------------------------------------------------ objects written by hand


def cond(
    ctype: str, value: str, reason: str = "", message: str = "", gen: int = GEN
) -> dict[str, Any]:
    return {
        "type": ctype,
        "status": value,
        "reason": reason or ("AsExpected" if value == "False" else ctype),
        "message": message,
        "lastTransitionTime": NOW,
        "observedGeneration": gen,
    }


def written(
    *conditions: dict[str, Any], rollout: dict[str, Any] | None = None, observed: int = GEN
) -> dict[str, Any]:
    st: dict[str, Any] = {"observedGeneration": observed, "conditions": list(conditions)}
    if rollout is not None:
        st["rollout"] = rollout
    return st


READY = cond("Ready", "True", "AllReplicasReady", "9/9 ready")
STEADY = (
    cond("Progressing", "False", "RolloutComplete"),
    cond("Degraded", "False"),
    cond("Reconciling", "False"),
    cond("Stalled", "False"),
)


@dataclass(frozen=True)
class HandCase:
    id: str
    obj: dict[str, Any]
    kstatus: str
    argo: str
    argo_message: str | None = None
    note: str = field(default="", compare=False)


HAND_CASES = [
    HandCase(
        "rollout-complete",
        infd(written(READY, *STEADY, rollout=ROLLOUTS["Complete"])),
        "Current",
        "Healthy",
        "9/9 ready",
    ),
    HandCase(
        "rollout-progressing",
        infd(
            written(
                READY,
                cond("Progressing", "True", "RollingOut", "site by site: wave 2/3"),
                cond("Degraded", "False"),
                cond("Reconciling", "True", "RollingOut", "site by site: wave 2/3"),
                cond("Stalled", "False"),
                rollout=ROLLOUTS["Progressing"],
            )
        ),
        "InProgress",
        "Progressing",
        "site by site: wave 2/3",
    ),
    HandCase(
        "rollout-paused",
        infd(
            written(
                READY,
                cond("Progressing", "True", "RolloutPaused", "paused: wave 2/3"),
                cond("Degraded", "False"),
                cond("Reconciling", "True", "RolloutPaused", "paused: wave 2/3"),
                cond("Stalled", "False"),
                rollout=ROLLOUTS["Paused"],
            )
        ),
        "InProgress",
        "Suspended",
        "wave 2/3 regional: 4/9 sites",
        note="kstatus has no Suspended; a paused Deployment is InProgress to it too",
    ),
    HandCase(
        "rollout-halted",
        infd(
            written(
                READY,
                cond("Progressing", "False", "RolloutHalted", ROLLOUTS["Halted"]["message"]),
                cond("Degraded", "True", "RolloutHalted", ROLLOUTS["Halted"]["message"]),
                cond("Reconciling", "False"),
                cond("Stalled", "True", "RolloutHalted", ROLLOUTS["Halted"]["message"]),
                rollout=ROLLOUTS["Halted"],
            )
        ),
        "Failed",
        "Degraded",
        ROLLOUTS["Halted"]["message"],
    ),
    HandCase(
        "rollout-rolled-back",
        infd(
            written(
                READY,
                cond("Progressing", "False", "RolledBack", ROLLOUTS["RolledBack"]["message"]),
                cond("Degraded", "True", "RolledBack", ROLLOUTS["RolledBack"]["message"]),
                cond("Reconciling", "False"),
                cond("Stalled", "True", "RolledBack", ROLLOUTS["RolledBack"]["message"]),
                rollout=ROLLOUTS["RolledBack"],
            )
        ),
        "Failed",
        "Degraded",
        ROLLOUTS["RolledBack"]["message"],
    ),
    HandCase(
        # status.rollout alone, no Stalled (an operator older than the pair): Argo CD still
        # reads the phase; kstatus, from Ready, cannot.
        "rollout-halted-phase-only",
        infd(written(READY, cond("Progressing", "False"), rollout=ROLLOUTS["Halted"])),
        "Current",
        "Degraded",
        ROLLOUTS["Halted"]["message"],
    ),
    HandCase(
        "stalled-spec",
        infd(
            written(
                cond("Ready", "False", "InvalidSpec", "bad"),
                cond("Progressing", "False", "InvalidSpec", "the spec cannot be served; fix it"),
                cond("Degraded", "True", "InvalidSpec", "bad"),
                cond("Reconciling", "False"),
                cond("Stalled", "True", "InvalidSpec", "spec.model.files[0]: no such file"),
            )
        ),
        "Failed",
        "Degraded",
        "spec.model.files[0]: no such file",
    ),
    HandCase(
        "generation-not-observed",
        infd(written(READY, *STEADY, rollout=ROLLOUTS["Complete"], observed=GEN - 1)),
        "InProgress",
        "Progressing",
        "waiting for the operator to observe generation 5 (observed: 4)",
    ),
    HandCase(
        # A condition left from the previous generation while status.observedGeneration is new
        # (a writer that updates one but not the other; the operator writes both at once).
        "condition-generation-stale",
        infd(written(cond("Ready", "True", gen=GEN - 1), *STEADY)),
        "Current",
        "Progressing",
        "waiting for the operator: condition Ready is for generation 4 of 5",
        note="kstatus v0.37.2 reads only status.observedGeneration, not the conditions'",
    ),
    HandCase(
        # Just created: the operator has not written any status yet.
        "no-status-yet",
        infd(None),
        "Current",
        "Progressing",
        "waiting for the operator to observe generation 5 (observed: none)",
        note="kstatus: no observedGeneration and no condition is Current (its rule for "
        "resources without a controller); wait on Argo CD or on status.observedGeneration",
    ),
    HandCase(
        "deleting",
        infd(written(READY, *STEADY), deletionTimestamp=NOW),
        "Terminating",
        "Progressing",
        "pending deletion",
    ),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.id)
def test_hand_written_status(case: HandCase) -> None:
    assert check_object(case.obj) == (case.kstatus, case.argo)
    if case.argo_message is not None:
        assert argo_health(case.obj)["message"] == case.argo_message


# ------------------------------------------------------------------ the pieces themselves


def test_argocd_cm_snippet_carries_the_script_verbatim() -> None:
    cm = yaml.safe_load(ARGOCD_CM.read_text())
    assert (cm["kind"], cm["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    assert cm["data"][ARGOCD_KEY] == ARGOCD_HEALTH.read_text()
    assert ARGOCD_KEY in ARGOCD_HEALTH.read_text()  # the install note names the key


def test_kstatus_harness_is_cached_and_reads_lists() -> None:
    built = kstatus.binary()
    mtime = built.stat().st_mtime_ns
    assert built.parent.name == kstatus.source_hash()
    assert kstatus.binary() == built and built.stat().st_mtime_ns == mtime
    objs = [infd(written(READY, *STEADY)), infd(written(READY, *STEADY), generation=GEN + 1)]
    got = kstatus.compute(objs)
    assert [r["status"] for r in got] == ["Current", "InProgress"]
    assert got[1]["message"] == (
        "InferenceDeployment generation is 6, but latest observed generation is 5"
    )
    assert kstatus.compute([]) == []
