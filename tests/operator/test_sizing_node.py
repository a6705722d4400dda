"""The operator's memory sizing against the real engine on the real kubelet node.

A replica of the size the operator renders (no `resources` in the spec: the memory request
and limit come from `ember_runtime.memory`, the rule the engine allocates by) serves
`maxBatchSize` concurrent requests, each run to the end of its context, and is not
OOM-killed; the same spec with a memory limit below that rule reports why instead of starting.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract import reasons

from tests.cluster.paths import bin_dir
from tests.cluster.procs import port_forward
from tests.conftest import Kube
from tests.operator import rest
from tests.operator.specs import hostpath_model, manifest
from tests.operator.test_reasons_node import MODELS, runtime_image  # noqa: F401 - fixture
from tests.support.model import MODEL_FILENAME
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]

CONTEXT = 512
SEQUENCES = 4
# ~40 tokens; repeated so each prompt takes about half the context and generation the rest.
TEXT = "The pump at Lake Farm reports its flow every minute, and the gateway forwards it. "


@pytest.fixture
def model_copy(namespace: str, gemma_gguf: Path) -> Iterator[Path]:
    path = MODELS / f"sizing-{namespace}"
    path.mkdir(parents=True)
    shutil.copyfile(gemma_gguf, path / MODEL_FILENAME)
    for item, mode in ((path, 0o755), (path / MODEL_FILENAME, 0o644)):
        item.chmod(mode)  # prewarm runs as uid 65532
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _infd(
    image: str, name: str, directory: Path, *, prewarm: bool = True, **extra: Any
) -> dict[str, Any]:
    size = (directory / MODEL_FILENAME).stat().st_size
    return manifest(
        name,
        model=hostpath_model(directory, size),
        image=image,
        engine={"contextLength": CONTEXT, "maxBatchSize": SEQUENCES, "minBatchSize": 1},
        prewarm={"enabled": prewarm},
        **extra,
    )


def _port_forward(
    kube: Kube, service: str, namespace: str
) -> contextlib.AbstractContextManager[int]:
    """`kubectl port-forward` to the Service's port through the real kubelet."""
    svc = rest.get(kube.api, "services", namespace, service) or {}
    kubectl = str(bin_dir() / "kubectl")
    return port_forward(
        kubectl, kube.kubeconfig, service, namespace, svc["spec"]["ports"][0]["port"]
    )


# Reasons that never clear by themselves (a transient FailedMount or Unschedulable on a busy
# node does, so those are waited out like any slow start).
FATAL = {reasons.OOM_KILLED, reasons.ENGINE_MEMORY_OVER_LIMIT, reasons.CRASH_LOOP_BACK_OFF}


def _ready_or_fail(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    """The Ready condition once True; fails at once, saying why, on a reason that is final."""
    degraded = rest.true_condition(kube.api, namespace, name, "Degraded")
    if degraded is not None and degraded["reason"] in FATAL:
        pods = rest.items(kube.api, "pods", namespace, label_selector=f"ember.dev/instance={name}")
        statuses = [p["status"].get("containerStatuses") for p in pods]
        pytest.fail(f"Degraded: {json.dumps(degraded)}\n{json.dumps(statuses, indent=1)}")
    return rest.true_condition(kube.api, namespace, name, "Ready")


def _runtime_status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    pods = rest.items(kube.api, "pods", namespace, label_selector=f"ember.dev/instance={name}")
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    statuses = pods[0]["status"].get("containerStatuses") or []
    return next(s for s in statuses if s["name"] == "runtime")


def _fill_context(port: int, index: int) -> dict[str, Any]:
    """One request whose prompt and completion together fill the sequence's `CONTEXT` cells."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    body: dict[str, Any] = {"prompt": f"Report {index}. " + TEXT * 6, "temperature": 0}
    probe = httpx.post(url, json={**body, "max_tokens": 1}, timeout=600)
    probe.raise_for_status()
    room = CONTEXT - int(probe.json()["usage"]["prompt_tokens"])
    response = httpx.post(url, json={**body, "max_tokens": room}, timeout=600)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_rendered_size_serves_every_sequence_at_full_context(
    kube: Kube,
    namespace: str,
    operator: Any,
    runtime_image: str,  # noqa: F811 - the imported fixture
    model_copy: Path,
) -> None:
    rest.create(kube.api, "infd", namespace, _infd(runtime_image, "sized", model_copy))
    wait_for("Ready", lambda: _ready_or_fail(kube, namespace, "sized"), timeout=600)
    deploy = rest.get(kube.api, "deployments", namespace, "sized") or {}
    containers = deploy["spec"]["template"]["spec"]["containers"]
    limit = next(c for c in containers if c["name"] == "runtime")["resources"]["limits"]
    assert "memory" in limit, limit  # sized by the operator, not left unbounded
    with (
        _port_forward(kube, "sized", namespace) as port,
        concurrent.futures.ThreadPoolExecutor(SEQUENCES) as pool,
    ):
        replies = list(pool.map(lambda i: _fill_context(port, i), range(SEQUENCES)))
    for reply in replies:
        usage, choice = reply["usage"], reply["choices"][0]
        # each sequence reached the end of its context (not an early stop)
        assert usage["total_tokens"] == CONTEXT, json.dumps(reply)[:400]
        assert choice["finish_reason"] == "length", json.dumps(reply)[:400]
    status = _runtime_status(kube, namespace, "sized")
    assert status["restartCount"] == 0, json.dumps(status)
    assert "terminated" not in (status.get("lastState") or {}), json.dumps(status)


def test_limit_below_the_rule_reports_the_reason(
    kube: Kube,
    namespace: str,
    operator: Any,
    runtime_image: str,  # noqa: F811 - the imported fixture
    model_copy: Path,
) -> None:
    # Without prewarm the runtime maps the model from the node's disk, so its page cache is
    # charged to the container: weights 241.6 + KV 36 + compute ~46 + runtime 192 MiB need more
    # than 400 MiB. The operator cannot tell (it accepts any limit without prewarm); the
    # runtime's check before it loads anything must say so.
    small = {"requests": {"cpu": "100m", "memory": "400Mi"}, "limits": {"memory": "400Mi"}}
    spec = _infd(runtime_image, "small", model_copy, prewarm=False, resources=small)
    rest.create(kube.api, "infd", namespace, spec)
    degraded = wait_for(
        "Degraded EngineMemoryOverLimit",
        lambda: (
            (d := rest.true_condition(kube.api, namespace, "small", "Degraded"))
            and d["reason"] == "EngineMemoryOverLimit"
            and d
        ),
        timeout=600,
        interval=1,
    )
    assert "needs" in degraded["message"] and "400 MiB" in degraded["message"], degraded
