"""End to end on the real local cluster: Helm → operator → prewarm → runtime → streamed chat.

On failure the test output carries events, `describe` and pod logs (Flow.dump).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.conftest import Kube, NodeHandle
from tests.e2e.flow import RELEASE, SYSTEM_NS, Flow
from tests.e2e.local import local_flow

pytestmark = pytest.mark.node
NAME = "gemma-e2e"


@pytest.fixture(scope="module")
def flow(node: NodeHandle, kube: Kube) -> Iterator[Flow]:
    flow = local_flow(kube.cluster)
    flow.install()
    yield flow


def test_serves_a_streamed_chat_completion(flow: Flow, namespace: str) -> None:
    flow.apply(flow.model_manifest(NAME, namespace))
    try:
        flow.wait_ready(NAME, namespace)
        tokens: list[str] = []
        with flow.port_forward(NAME, namespace, 8080) as port:
            text = flow.chat(port, "Name one primary colour.", tokens.append)
    except Exception:
        print(flow.dump(namespace))
        raise
    assert len([t for t in tokens if t]) > 3, tokens  # streamed: many chunks, not one
    assert text.strip()
    row = flow.run_kubectl("get", "infd", NAME, "-n", namespace, "--no-headers")
    assert row.split()[1] == "1/1", row  # the READY printer column
    obj = json.loads(flow.run_kubectl("get", "infd", NAME, "-n", namespace, "-o", "json"))
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


def test_helm_uninstall_leaves_nothing_behind(flow: Flow) -> None:
    flow.uninstall()

    def leftovers() -> str:
        return flow.run_kubectl(
            "get",
            "all,serviceaccounts,configmaps,roles,rolebindings",
            "-n",
            SYSTEM_NS,
            "-l",
            f"app.kubernetes.io/instance={RELEASE}",
            "-o",
            "name",
        ).strip()

    # Pods finish terminating (their SIGTERM handling) after `helm uninstall --wait` returns.
    deadline = time.monotonic() + 60
    while leftovers() and time.monotonic() < deadline:
        time.sleep(1)
    assert not leftovers(), leftovers()
    cluster_scoped = flow.run_kubectl(
        "get",
        "clusterroles,clusterrolebindings",
        "-l",
        f"app.kubernetes.io/instance={RELEASE}",
        "-o",
        "name",
    )
    assert not cluster_scoped.strip(), cluster_scoped
    # By design (Helm's crds/ convention, see README): CRDs outlive the release so that
    # uninstalling never deletes users' InferenceDeployments.
    assert "inferencedeployments.ember.dev" in flow.run_kubectl("get", "crd", "-o", "name")
