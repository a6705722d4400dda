"""Every reason a user can see on an InferenceDeployment, in one place.

Prewarm and the runtime write a reason into their container's termination message; the operator
reads it back (`parse_termination_message`) and makes it the `Degraded` reason, beside its own
reasons and the kubelet's. The message format is defined here once, writer and parser side by
side, so the two ends cannot drift apart again (prewarm once wrote `checksum mismatch: …` while
the operator looked for `ChecksumMismatch: …`).

The README's troubleshooting table is generated from `REASONS` (`python -m
ember_runtime.contract.reasons README.md` rewrites it; a test fails when it is stale).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ember_runtime.contract import thermal

# Who reports a reason. Node-side reasons are the only ones a termination message may carry.
PREWARM, RUNTIME, OPERATOR, KUBELET, SCHEDULER = (
    "prewarm",
    "runtime",
    "operator",
    "kubelet",
    "scheduler",
)
NODE_SIDE = frozenset({PREWARM, RUNTIME})
# The kubelet caps a termination message at 4096 bytes; keep the whole line within it.
MAX_TERMINATION_MESSAGE = 4096


@dataclass(frozen=True)
class Reason:
    name: str
    source: str
    condition: str  # where it shows: Degraded (and STATUS), Ready, Progressing, Throttled…
    action: str  # what the user should do about it


REASONS: dict[str, Reason] = {}


def _define(name: str, source: str, action: str, condition: str = "Degraded") -> str:
    if name in REASONS:
        raise ValueError(f"reason {name} defined twice")
    REASONS[name] = Reason(name, source, condition, action)
    return name


# --- prewarm (init container) ---------------------------------------------------------------
CHECKSUM_MISMATCH = _define(
    "ChecksumMismatch",
    PREWARM,
    "A model file's sha256 differs from `spec.model.files` (message: expected/got). The file on "
    "the node is corrupt or another version: replace it, or correct the sha256.",
)
SIZE_MISMATCH = _define(
    "SizeMismatch",
    PREWARM,
    "A model file's size differs from `sizeBytes`: an incomplete copy or another version. "
    "Replace the file or correct the spec.",
)
MODEL_FILE_MISSING = _define(
    "ModelFileMissing",
    PREWARM,
    "A file listed in `spec.model.files` is not in the model directory on the node. Copy it "
    "there (check `path` against the source's layout).",
)
SHARED_MEMORY_FULL = _define(
    "SharedMemoryFull",
    PREWARM,
    "The memory-backed prewarm volume cannot hold the model: too small before copying "
    "(message: free and needed bytes), or it filled up while copying. Raise "
    "`prewarm.sharedMemoryLimit` (and the memory limit with it).",
)
PREFLIGHT_FAILED = _define(
    "PreflightFailed",
    PREWARM,
    "A node check failed before anything was copied (message: which). Run "
    "`python -m ember_runtime.prewarm diagnose` on the node for the whole table.",
)
MODEL_READ_ERROR = _define(
    "ModelReadError",
    PREWARM,
    "Reading a model file or writing its copy failed (message: the file and the OS error). "
    "Check the disk and the files' permissions for uid 65532.",
)
CONFIG_INVALID = _define(
    "ConfigInvalid",
    PREWARM,
    "Prewarm could not read its ConfigMap: the runtime image and the operator are different "
    "versions. Use the image that matches the operator.",
)
DRAFT_VOCABULARY_MISMATCH = _define(
    "DraftVocabularyMismatch",
    PREWARM,
    "`engine.speculation.draftModel` names a model whose vocabulary differs from the served "
    "model's (message: the first difference: tokenizer, size, token list, begin or end "
    "token). Its draft tokens would mean other text: use a draft model of the same family, "
    "or remove draftModel (drafts then come from the request's own text).",
)
PREWARM_INTERRUPTED = _define(
    "PrewarmInterrupted",
    PREWARM,
    "Prewarm was stopped by SIGTERM (pod deleted or evicted while copying). Nothing to do "
    "unless it repeats; the next pod copies again.",
)
PREWARM_FAILED = _define(
    "PrewarmFailed",
    PREWARM,
    "Prewarm exited without a known reason (message: its last output). Read "
    "`kubectl logs <pod> -c prewarm`.",
)
MODEL_DOWNLOADING = _define(
    "ModelDownloading",
    PREWARM,
    "An `http` source's files are still being fetched into the node's cache by the node agent "
    "(message: each waiting node's bytes done of the total and ETA, reported by the node agent "
    "within seconds of a replica starting to wait and then every 30 s). Nothing to do unless "
    "it lasts: then check `kubectl logs` of the `ember-nodeagent` pod on that node and the "
    "origin's reachability.",
)
MODEL_DOWNLOAD_FAILED = _define(
    "ModelDownloadFailed",
    PREWARM,
    "The node agent could not fetch an `http` source's file (message: the URL's host and the "
    "origin's answer, e.g. HTTP 404 or 401). Fix the URL, the origin, or `secretRef`'s Secret.",
)
# --- runtime (serving container) ------------------------------------------------------------
ENGINE_MEMORY_OVER_LIMIT = _define(
    "EngineMemoryOverLimit",
    RUNTIME,
    "The engine's memory (KV cache, buffers, weights) would exceed the container's limit, so "
    "the runtime refused to start. Lower `engine.maxBatchSize` or `engine.contextLength`, or "
    "raise `resources.limits.memory`.",
)
RUNTIME_START_FAILED = _define(
    "RuntimeStartFailed",
    RUNTIME,
    "The runtime could not load the model or start serving (message: why). Read "
    "`kubectl logs <pod> -c runtime`.",
)
# --- operator: specs that pass the schema but cannot be served --------------------------------
SHARED_MEMORY_TOO_SMALL = _define(
    "SharedMemoryTooSmall",
    OPERATOR,
    "`prewarm.sharedMemoryLimit` is smaller than the model files. Raise it or disable prewarm.",
)
MEMORY_LIMIT_TOO_SMALL = _define(
    "MemoryLimitTooSmall",
    OPERATOR,
    "`resources.limits.memory` cannot hold the prewarm volume. Raise it.",
)
INVALID_SPEC = _define(
    "InvalidSpec",
    OPERATOR,
    "The stored spec does not parse (a CRD older than the operator). Apply the CRDs from "
    "`crds/` with `kubectl apply --server-side`.",
)
APPLY_REJECTED = _define(
    "ApplyRejected",
    OPERATOR,
    "The API server refused a child object (message: its answer), e.g. a quota or an admission "
    "policy. Fix what the message names.",
)
# --- scheduler and kubelet: the pod's own state, with the kubelet's message -------------------
UNSCHEDULABLE = _define(
    "Unschedulable",
    SCHEDULER,
    "No node can take the replica (message: the scheduler's, e.g. `Insufficient cpu`). Free "
    "the resource, add a node, or relax `placement`.",
)
OOM_KILLED = _define(
    "OOMKilled",
    KUBELET,
    "A container was killed for exceeding its memory limit (message: the limit). Raise "
    "`resources.limits.memory` or lower `engine.maxBatchSize`/`contextLength`.",
)
CRASH_LOOP_BACK_OFF = _define(
    "CrashLoopBackOff",
    KUBELET,
    "A container keeps exiting (message: its last termination message). Read "
    "`kubectl logs <pod> -c <container> --previous`.",
)
IMAGE_PULL_BACK_OFF = _define(
    "ImagePullBackOff",
    KUBELET,
    "The image cannot be pulled (message: the kubelet's). Check `spec.image`, the registry and "
    "pull secrets.",
)
ERR_IMAGE_PULL = _define(
    "ErrImagePull", KUBELET, "The first pull of the image failed; see ImagePullBackOff."
)
ERR_IMAGE_NEVER_PULL = _define(
    "ErrImageNeverPull",
    KUBELET,
    "The pull policy is `Never` and the image is not on the node. Load it onto the node.",
)
INVALID_IMAGE_NAME = _define(
    "InvalidImageName", KUBELET, "`spec.image` is not a valid image reference. Fix it."
)
CREATE_CONTAINER_CONFIG_ERROR = _define(
    "CreateContainerConfigError",
    KUBELET,
    "The kubelet cannot build the container's configuration, e.g. a missing Secret for "
    "`server.apiKeySecretRef`. Create what the message names.",
)
CREATE_CONTAINER_ERROR = _define(
    "CreateContainerError",
    KUBELET,
    "The container runtime failed to create the container (message: why).",
)
RUN_CONTAINER_ERROR = _define(
    "RunContainerError",
    KUBELET,
    "The container runtime failed to start the container (message: why), e.g. a missing "
    "device node for an accelerator.",
)
FAILED_MOUNT = _define(
    "FailedMount",
    KUBELET,
    "A volume cannot be mounted, e.g. a `hostPath` model directory that does not exist on the "
    "node (message: the kubelet's). Create the directory or fix `model.source`.",
)
FAILED_ATTACH_VOLUME = _define(
    "FailedAttachVolume",
    KUBELET,
    "The model's PVC cannot be attached to the node (message: the storage driver's).",
)
FAILED_MAP_VOLUME = _define(
    "FailedMapVolume", KUBELET, "A block volume cannot be mapped (message: why)."
)
FAILED_CREATE_POD_SANDBOX = _define(
    "FailedCreatePodSandBox",
    KUBELET,
    "The node cannot start the pod's sandbox, usually its network (CNI) plugin. Check the "
    "node's container runtime and CNI.",
)
# Kubelet warning Events (not container states) that leave a pod stuck before any container
# starts; the operator watches only these (`involvedObject.kind=Pod`, `type=Warning`).
POD_EVENT_REASONS = frozenset(
    {FAILED_MOUNT, FAILED_ATTACH_VOLUME, FAILED_MAP_VOLUME, FAILED_CREATE_POD_SANDBOX}
)
# --- conditions that are not failures ---------------------------------------------------------
AS_EXPECTED = _define("AsExpected", OPERATOR, "Nothing is wrong.")
ALL_REPLICAS_READY = _define("AllReplicasReady", OPERATOR, "Serving.", condition="Ready")
SCALED_TO_ZERO = _define("ScaledToZero", OPERATOR, "`replicas` is 0.", condition="Ready")
REPLICAS_NOT_READY = _define(
    "ReplicasNotReady",
    OPERATOR,
    "Replicas are starting (prewarm, model load). If it lasts, `Degraded` says why.",
    condition="Ready",
)
ROLLING_OUT = _define("RollingOut", OPERATOR, "A rollout is in progress.", condition="Progressing")
ROLLOUT_COMPLETE = _define(
    "RolloutComplete", OPERATOR, "All replicas run the current spec.", condition="Progressing"
)
# Site-by-site rollouts (spec.rollout; docs/fleet.md).
ROLLOUT_PAUSED = _define(
    "RolloutPaused",
    OPERATOR,
    "spec.rollout.paused holds the rollout; sites keep their versions. Set it to false to go on.",
    condition="Progressing",
)
ROLLOUT_HALTED = _define(
    "RolloutHalted",
    OPERATOR,
    "A site of the current wave is unreachable (no node Ready past unreachableAfterSeconds) and "
    "onUnreachable is Halt. Bring the site back, or set onUnreachable: Skip to go on without it.",
)
ROLLED_BACK = _define(
    "RolledBack",
    OPERATOR,
    "A site failed its health gate (message: which, and why) or spec.rollout.rollback is set; "
    "every changed site runs the previous version again, from its node cache. Fix the spec "
    "(a new revision starts a new rollout) or revert it.",
)
THERMAL_THROTTLING = _define(
    "ThermalThrottling",
    OPERATOR,
    "Hot replicas run a smaller batch (message: which, at what temperature). Cool the device "
    "or accept the lower throughput.",
    condition="Throttled",
)
FULL_BATCH = _define(
    "FullBatch", OPERATOR, "Every replica runs at its full batch.", condition="Throttled"
)
THERMAL_POLICY_OFF = _define(
    "ThermalPolicyOff", OPERATOR, "`thermal.policy` is static (or off).", condition="Throttled"
)
# The runtime's and node agent's own ember.dev/Thermal condition (names in contract/thermal.py).
_THERMAL = thermal.THERMAL_CONDITION
_define(thermal.REASON_NORMAL, RUNTIME, "Below the throttle temperature.", condition=_THERMAL)
_define(
    thermal.REASON_THROTTLED,
    RUNTIME,
    "Above `thermal.throttleCelsius`: the batch is lowered.",
    condition=_THERMAL,
)
_define(
    thermal.REASON_CRITICAL,
    RUNTIME,
    "At or above `thermal.criticalCelsius`; held for `criticalForSeconds`, the node is tainted "
    "and its replicas move.",
    condition=_THERMAL,
)
_define(
    thermal.REASON_NO_READING,
    RUNTIME,
    "No temperature sensor found: full batch. Check `operator.sensorsSysfsRoot`.",
    condition=_THERMAL,
)
_define(
    thermal.REASON_POLICY_OFF, RUNTIME, "`thermal.policy` is static (or off).", condition=_THERMAL
)
_define(
    thermal.REASON_SENSOR_UNAVAILABLE,
    RUNTIME,
    "A configured sensor cannot start or read (message: which and why, e.g. NVML without a "
    "driver): full batch, no temperature. Also shown on the object's Throttled condition. Fix "
    "the driver or `npu-smi`; the runtime retries by itself.",
    condition=_THERMAL,
)


# --- LoRA adapters (spec.adapters, issue 47) --------------------------------------------------
# The runtime keeps `ADAPTERS_CONDITION` on its own Pod (beside ember.dev/Thermal and
# ember.dev/Health; the chart's admission policy lets it change only those): which adapters it
# serves and why it refuses the others. The operator folds its replicas' reports into the
# InferenceDeployment's `AdaptersReady` condition; Ready is not touched (the base serves on).
ADAPTERS_CONDITION = "ember.dev/Adapters"
ADAPTERS_READY = "AdaptersReady"
ADAPTERS_PREFIX = "ember.dev/adapters.v1 "
MAX_ADAPTERS = 64  # the CRD's spec.adapters maxItems
MAX_ADAPTER_REASON = 512
ADAPTER_REFUSED = _define(
    "AdapterRefused",
    RUNTIME,
    "A LoRA adapter of `spec.adapters` is not served; the base and the other adapters are "
    "(message: the adapter and why: a sha256 that differs from the file, an adapter of "
    "another base model, a file not found or not fetched yet). Fix the file or the entry; "
    "the runtime tries again when its file changes, with no restart.",
    condition=ADAPTERS_READY,
)
ADAPTERS_SERVED = _define(
    "AdaptersServed",
    RUNTIME,
    "Every adapter of `spec.adapters` is served by every replica that reports.",
    condition=ADAPTERS_READY,
)


@dataclass(frozen=True)
class AdapterReport:
    """One replica's adapters: the names it serves, and (name, why) for each it refuses."""

    served: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()

    @property
    def reason(self) -> str:
        return ADAPTER_REFUSED if self.refused else ADAPTERS_SERVED

    def summary(self) -> str:
        if not self.refused:
            return f"{len(self.served)} served"
        return "; ".join(f"{name}: {why}" for name, why in self.refused)


def adapters_condition(report: AdapterReport, now: str) -> dict[str, object]:
    """The runtime's pod condition: the human line, then `ADAPTERS_PREFIX` + JSON."""
    data = {"served": list(report.served), "refused": dict(report.refused)}
    return {
        "type": ADAPTERS_CONDITION,
        "status": "False" if report.refused else "True",
        "reason": report.reason,
        "message": f"{report.summary()}\n{ADAPTERS_PREFIX}{json.dumps(data, sort_keys=True)}",
        "lastTransitionTime": now,
    }


def parse_adapters_condition(conditions: list[dict[str, object]] | None) -> AdapterReport | None:
    """The `ADAPTERS_CONDITION` among a Pod's conditions, typed; None if absent or not one
    `adapters_condition` wrote (the writer is a tenant's pod: bounded, never trusted)."""
    cond = next((c for c in conditions or [] if c.get("type") == ADAPTERS_CONDITION), None)
    if cond is None:
        return None
    try:
        report = _decode_adapters(str(cond.get("message") or ""))
    except ValueError:
        return None
    return report if cond.get("reason") == report.reason else None


def _decode_adapters(message: str) -> AdapterReport:
    _, sep, payload = message.partition(ADAPTERS_PREFIX)
    data = json.loads(payload) if sep else None
    if not isinstance(data, dict):
        raise ValueError("no adapters report")
    served, refused = data.get("served"), data.get("refused")
    if not isinstance(served, list) or not isinstance(refused, dict):
        raise ValueError("malformed adapters report")
    names = [*served, *refused]
    if len(names) > MAX_ADAPTERS or not all(
        isinstance(n, str) and 0 < len(n) <= 253 for n in names
    ):
        raise ValueError("malformed adapter names")
    if not all(isinstance(w, str) for w in refused.values()):
        raise ValueError("malformed adapter reasons")
    why = {n: " ".join(w.split())[:MAX_ADAPTER_REASON] for n, w in refused.items()}
    return AdapterReport(tuple(served), tuple(sorted(why.items())))


# --- the termination message: writer and parser ----------------------------------------------
def termination_message(reason: str, detail: str) -> str:
    """`Reason: detail` on one line: what prewarm and the runtime write to the termination log."""
    if REASONS.get(reason) is None or REASONS[reason].source not in NODE_SIDE:
        raise ValueError(f"{reason!r} is not a node-side reason")
    line = f"{reason}: {' '.join(detail.split())}"  # the status shows one line
    return line.encode()[:MAX_TERMINATION_MESSAGE].decode(errors="ignore")


def parse_termination_message(text: str) -> tuple[str, str] | None:
    """(reason, detail) of a message `termination_message` wrote; None for anything else (a
    crash's log tail, an older image's free text)."""
    reason, sep, detail = text.strip().partition(": ")
    known = REASONS.get(reason)
    if not sep or known is None or known.source not in NODE_SIDE:
        return None
    return reason, detail.strip()


def write_termination_message(path: str | Path, reason: str, detail: str) -> str:
    """Write the line to the container's termination log; returns it. Raises OSError."""
    line = termination_message(reason, detail)
    Path(path).write_text(line + "\n")
    return line


# --- the README's troubleshooting table -------------------------------------------------------
BEGIN, END = "<!-- reasons:begin -->", "<!-- reasons:end -->"


def markdown_table() -> str:
    rows = ["| reason | from | shows in | what to do |", "|---|---|---|---|"]
    for r in REASONS.values():
        rows.append(f"| `{r.name}` | {r.source} | {r.condition} | {r.action} |")
    return "\n".join(rows)


def with_table(readme: str) -> str:
    """`readme` with the text between the markers replaced by `markdown_table()`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"README has no {BEGIN} … {END} block")
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    """`python -m ember_runtime.contract.reasons README.md`: rewrite the table in place."""
    for name in argv:
        path = Path(name)
        path.write_text(with_table(path.read_text()))
    if not argv:
        print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
