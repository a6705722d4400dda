"""Fault drills on the real cluster: the operator under abuse (kill -9 during churn, fuzzed
specs), the device plugin across kubelet restarts; and, off the cluster, the runtime under
overload and prewarm on broken files and a full memory-backed volume. Each drill has a short
version that runs in the suite (marked `cluster`/`node` where it needs them) and a full one for
`make drills` (EMBER_DRILL_SCALE=full); see tests/drills/common.py."""

from __future__ import annotations

from tests.deviceplugin.realnode import plugin  # noqa: F401  (the plugin on the real kubelet)
from tests.operator.conftest import crd  # noqa: F401  (the CRD on the real API server)
