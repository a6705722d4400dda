"""Operator test fixtures: the real Gemma GGUF, the CRD installed on the real API server, and
the operator running in-process under `kopf.testing.KopfRunner`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M GGUF (assembled into the XDG cache once)."""
    from tests.support.model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def crd(kube: Any) -> Any:
    """Install crds/ on the API server and wait until the InferenceDeployment CRD is served."""
    os.environ["KUBECONFIG"] = str(kube.kubeconfig)  # Kopf's own login reads it
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kube.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/inferencedeployments.ember.dev",
    )
    return kube


@contextmanager
def running_operator(namespace: str) -> Iterator[Any]:
    from kopf.testing import KopfRunner

    args = ["run", "--standalone", "--namespace", namespace, "-m", "ember_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert "Traceback" not in runner.output, runner.output


@pytest.fixture
def operator(crd: Any, namespace: str) -> Iterator[Any]:
    with running_operator(namespace) as runner:
        yield runner
