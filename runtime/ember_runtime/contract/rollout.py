"""Fleet rollouts' contract: what crosses processes while a new version moves site by site.

- The replica's **health report**: the runtime keeps the `ember.dev/Health` condition on its own
  Pod (as it keeps `ember.dev/Thermal`): finished requests, server errors and TTFT p99 over a
  recent window, and whether heat throttled it meanwhile. The operator's health gate compares a
  site's new-version replicas with what its previous-version replicas reported. Encoded like the
  thermal report: the human line, then one line `HEALTH_PREFIX` + JSON; one encoder, one decoder
  that refuses anything it did not write (the writer is a tenant's pod: never trusted).
- The **stage request**: before a site's pods change, the operator annotates the site's Nodes
  `stage.ember.dev/<16 hex of sha256("<namespace>/<name>")>: "<namespace>/<name>"`. The node agent
  reads it from its own Node as it reads a pod's claim: a place to look, never what to fetch. It
  fetches the named InferenceDeployment's `spec.model` (the version rolling out) into its cache
  and, while the annotation stands, keeps the previous version's files too
  (`status.rollout.stableSpec.model`, written by the operator only) so a rollback needs no WAN
  fetch. The operator removes the annotation when the rollout ends.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, Final

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel
from pydantic.dataclasses import dataclass

HEALTH_CONDITION: Final = "ember.dev/Health"
HEALTH_PREFIX: Final = "ember.dev/health.v1 "
# The condition's status and reason: is the replica serving without server errors.
REASON_SERVING: Final = "Serving"
REASON_ERRORS: Final = "ServerErrors"
REASON_IDLE: Final = "Idle"  # nothing finished in the window: no evidence either way
MAX_COUNT = 10**9
MAX_MS = 3_600_000

STAGE_ANNOTATION_PREFIX: Final = "stage.ember.dev/"
STAGE_KEY_HEX = 16
# Where the node agent reads the previous version's model on an InferenceDeployment.
STABLE_MODEL_PATH: Final = ("status", "rollout", "stableSpec", "model")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


@dataclass(
    frozen=True,
    config=ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True),
)
class HealthReport:
    """What one replica says of its last `window_seconds`: `requests` finished, `errors` of them
    failed on the server's side (5xx, an engine failure; a client's 4xx is not the version's
    fault), the p99 time to first token of those served while not throttled (None: none were),
    and whether heat throttled the replica in the window (its TTFT is then not the version's)."""

    requests: Count
    errors: Count
    ttft_p99_ms: Annotated[int, Field(ge=0, le=MAX_MS)] | None
    throttled: bool
    window_seconds: Annotated[int, Field(ge=1, le=86_400)]

    @property
    def reason(self) -> str:
        if self.errors:
            return REASON_ERRORS
        return REASON_SERVING if self.requests else REASON_IDLE

    def message(self) -> str:
        ttft = "no TTFT" if self.ttft_p99_ms is None else f"TTFT p99 {self.ttft_p99_ms} ms"
        heat = ", throttled" if self.throttled else ""
        return (
            f"{self.requests} requests, {self.errors} errors in {self.window_seconds}s, "
            f"{ttft}{heat}"
        )


_REPORT = TypeAdapter(HealthReport)


class HealthReportError(ValueError):
    """A condition message that is not a report `health_condition` wrote."""


def encode_health(report: HealthReport) -> str:
    data = _REPORT.dump_json(report, by_alias=True).decode()
    return f"{report.message()}\n{HEALTH_PREFIX}{data}"


def decode_health(message: str) -> HealthReport:
    _, newline, last = message.rpartition("\n")
    if not newline or not last.startswith(HEALTH_PREFIX):
        raise HealthReportError(f"no {HEALTH_PREFIX.strip()} line in the message")
    try:
        report = _REPORT.validate_json(last.removeprefix(HEALTH_PREFIX), strict=True)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise HealthReportError(f"malformed health report: {err['msg']}") from exc
    if report.errors > report.requests:
        raise HealthReportError("more errors than requests")
    return report


def health_condition(report: HealthReport, now: str) -> dict[str, Any]:
    return {
        "type": HEALTH_CONDITION,
        "status": "False" if report.errors else "True",
        "reason": report.reason,
        "message": encode_health(report),
        "lastTransitionTime": now,
    }


def parse_health_condition(conditions: list[dict[str, Any]] | None) -> HealthReport | None:
    """The `ember.dev/Health` condition among a Pod's conditions, typed; None if absent or not
    one `health_condition` wrote (its reason and status must agree with its data)."""
    cond = next((c for c in conditions or [] if c.get("type") == HEALTH_CONDITION), None)
    if cond is None:
        return None
    try:
        report = decode_health(str(cond.get("message") or ""))
    except HealthReportError:
        return None
    status = "False" if report.errors else "True"
    if cond.get("reason") != report.reason or cond.get("status") != status:
        return None
    return report


# ----------------------------------------------------------------------------- stage requests


def stage_annotation(namespace: str, name: str) -> tuple[str, str]:
    """(key, value) of the stage request for one InferenceDeployment on a Node."""
    value = f"{namespace}/{name}"
    digest = hashlib.sha256(value.encode()).hexdigest()[:STAGE_KEY_HEX]
    return f"{STAGE_ANNOTATION_PREFIX}{digest}", value


def stage_requests(annotations: dict[str, str] | None) -> list[tuple[str, str]]:
    """The (namespace, name) pairs a Node's annotations ask its agent to stage. A value that is
    not two object names, or whose key does not match it, is ignored: whoever can annotate the
    Node can at most name an InferenceDeployment, whose own spec says what to fetch."""
    out: list[tuple[str, str]] = []
    for key, value in (annotations or {}).items():
        if not key.startswith(STAGE_ANNOTATION_PREFIX):
            continue
        namespace, slash, name = str(value).partition("/")
        if not slash or not (_NAME.fullmatch(namespace) and _NAME.fullmatch(name)):
            continue
        if stage_annotation(namespace, name)[0] != key:
            continue
        out.append((namespace, name))
    return sorted(out)


def stable_model(obj: dict[str, Any]) -> Any:
    """The previous version's `spec.model` an InferenceDeployment keeps while it rolls out."""
    node: Any = obj
    for part in STABLE_MODEL_PATH:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node
