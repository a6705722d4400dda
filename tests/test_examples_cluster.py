"""Every manifest under examples/ is accepted by the real API server with the generated CRD."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Kube

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd(kube: Kube) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/inferencedeployments.ember.dev"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_is_valid(crd: None, kube: Kube, namespace: str, example: Path) -> None:
    out = kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))
    assert "(server dry run)" in out
