"""Fault drills: the operator under abuse (kill -9 during churn, fuzzed specs) on the real
control plane. Each drill has a short version that runs in the suite (marked `cluster`) and a
full one for `make drills` (EMBER_DRILL_SCALE=full); see tests/drills/common.py."""

from __future__ import annotations

from tests.operator.conftest import crd  # noqa: F401  (the CRD on the real API server)
