"""Fault drills on the real cluster: the operator under abuse (kill -9 during churn, fuzzed
specs), the device plugin across kubelet restarts; and, off the cluster, the runtime under
overload and prewarm on broken files and a full memory-backed volume. Each drill has a short
version that runs in the suite (marked `cluster`/`node` where it needs them) and a full one for
`make drills` (EMBER_DRILL_SCALE=full); see tests/drills/common.py."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from tests.deviceplugin.realnode import plugin  # noqa: F401  (the plugin on the real kubelet)
from tests.drills import common
from tests.operator.conftest import crd  # noqa: F401  (the CRD on the real API server)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, Any]:
    """A full drill's verdict goes into bench/results/drills.* beside its figures."""
    report = yield
    if report.when == "call" and (drill := common.RECORDED.pop(item.nodeid, None)):
        # The first `E ` line of the failure: the assertion and its message.
        errors = [ln[1:].strip() for ln in report.longreprtext.splitlines() if ln[:2] == "E "]
        common.verdict(drill, report.passed, errors[0] if errors else report.longreprtext[-400:])
    return report
