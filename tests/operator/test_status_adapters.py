"""The AdaptersReady condition (issue 47): the operator folds its replicas' own
`ember.dev/Adapters` reports (written by the runtime's `adapters_condition`) into the
InferenceDeployment's status; a refused adapter says which and why, and Ready stays as it is."""

from __future__ import annotations

from typing import Any

from ember_operator import status
from ember_runtime.contract import reasons
from ember_runtime.contract.reasons import AdapterReport, adapters_condition

from tests.operator.specs import deployment, wire_status

NOW = "2026-01-01T00:00:00Z"
WRONG_SHA = "sha256 mismatch: the file has 9f3c, engine.adapters says ab12"


def _summary(name: str, *conditions: dict[str, Any], deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = NOW
    body = {
        "metadata": meta,
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}, *conditions],
        },
    }
    return status.pod_summary(body)


def _status(*pods: dict[str, Any]) -> dict[str, Any]:
    obs = status.Observed(
        generation=2,
        desired=len(pods),
        deployment=deployment(len(pods), len(pods)),
        pods=list(pods),
        problems=[],
        selector="a=b",
    )
    return wire_status(obs, {}, NOW)


def _cond(st: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in st["conditions"] if c["type"] == ctype), None)


def test_a_refused_adapter_is_named_with_its_reason_and_ready_stays() -> None:
    refused = AdapterReport(("style-a",), (("style-b", WRONG_SHA),))
    served = AdapterReport(("style-a", "style-b"))
    st = _status(
        _summary("p-1", adapters_condition(refused, NOW)),
        _summary("p-2", adapters_condition(served, NOW)),
    )
    cond = _cond(st, reasons.ADAPTERS_READY)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", "AdapterRefused")
    assert cond["message"] == f"1 adapter(s) refused: style-b: {WRONG_SHA}"
    ready = _cond(st, "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")
    assert st["reason"] == "AllReplicasReady"  # the summary column is not Degraded


def test_all_served_is_true_and_no_report_means_no_condition() -> None:
    served = AdapterReport(("style-a", "style-b"))
    st = _status(_summary("p-1", adapters_condition(served, NOW)))
    cond = _cond(st, reasons.ADAPTERS_READY)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("True", "AdaptersServed")
    assert cond["message"] == "2 adapter(s) served by 1 replica(s)"
    assert _cond(_status(_summary("p-1")), reasons.ADAPTERS_READY) is None
    # A replica on its way out does not speak for the deployment.
    refused = AdapterReport((), (("x", WRONG_SHA),))
    gone = _summary("p-0", adapters_condition(refused, NOW), deleting=True)
    st = _status(gone, _summary("p-1", adapters_condition(served, NOW)))
    cond = _cond(st, reasons.ADAPTERS_READY)
    assert cond is not None and cond["status"] == "True"


def test_a_forged_or_malformed_report_is_ignored() -> None:
    good = adapters_condition(AdapterReport((), (("x", WRONG_SHA),)), NOW)
    forged = [
        {**good, "reason": "AdaptersServed"},  # reason and data disagree
        {**good, "message": "x: refused"},  # no data line
        {**good, "message": f"{reasons.ADAPTERS_PREFIX}" + '{"served": 1, "refused": {}}'},
        {**good, "message": f"{reasons.ADAPTERS_PREFIX}" + '{"served": [], "refused": {"": "x"}}'},
    ]
    for condition in forged:
        assert reasons.parse_adapters_condition([condition]) is None, condition
        assert _cond(_status(_summary("p-1", condition)), reasons.ADAPTERS_READY) is None
    long = adapters_condition(AdapterReport((), (("x", "why " * 400),)), NOW)
    report = reasons.parse_adapters_condition([long])
    assert report is not None and len(report.refused[0][1]) == reasons.MAX_ADAPTER_REASON
