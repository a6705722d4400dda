"""LoRA adapters hot-plugged on the real kubelet node (issue 47): an InferenceDeployment with
one adapter on a hostPath source serves it; a second adapter added by patching the spec is
served by the same pod, never restarted (the ConfigMap changes, the pod template does not; the
kubelet refreshes the mounted file and the runtime reloads it). A refused adapter added the same
way answers 404 with its reason while the base and the others serve on, and the object's
`AdaptersReady` condition names it (from the runtime's own pod condition, written through the
chart's runtime RBAC and admission policy)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.control_plane import HOST_IP
from tests.conftest import Kube
from tests.operator import rest
from tests.operator.specs import hostpath_model, manifest
from tests.operator.test_reasons_node import MODELS, runtime_image  # noqa: F401 - fixture
from tests.operator.test_sizing_node import _port_forward, _ready_or_fail
from tests.support.lora import write_lora
from tests.support.model import MODEL_FILENAME, sha256_file
from tests.support.waiting import wait_for
from tests.thermal.kube_support import runtime_policy

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]

PROMPT = "The capital of France is"
# The kubelet's pod sync (its ConfigMap refresh) plus the runtime's reload tick, with room.
RELOAD_TIMEOUT = 420  # a loaded CI machine: the kubelet syncs pods later
# The runtime's pod condition, then the operator's status refresh (seconds when idle; CI once
# saw none in 120 s, before on_fail showed the pod's side).
CONDITION_TIMEOUT = 240


@pytest.fixture
def model_dir(namespace: str, gemma_gguf: Path) -> Iterator[Path]:
    path = MODELS / f"adapters-{namespace}"
    (path / "loras").mkdir(parents=True)
    shutil.copyfile(gemma_gguf, path / MODEL_FILENAME)
    write_lora(gemma_gguf, path / "loras" / "a.gguf", seed=1)
    write_lora(gemma_gguf, path / "loras" / "b.gguf", seed=2)
    for item in (path, path / "loras"):
        item.chmod(0o755)
    for item in (path / MODEL_FILENAME, path / "loras" / "a.gguf", path / "loras" / "b.gguf"):
        item.chmod(0o644)  # prewarm and the runtime run as uid 65532
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _adapter(directory: Path, name: str, file: str, sha256: str | None = None) -> dict[str, Any]:
    path = directory / "loras" / file
    return {
        "name": name,
        "path": f"loras/{file}",
        "sha256": sha256 or sha256_file(path),
        "sizeBytes": path.stat().st_size,
    }


def _complete(port: int, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)


def _text(port: int, model: str) -> str:
    reply = _complete(port, model)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _models(port: int) -> list[str]:
    reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
    return [m["id"] for m in reply.json()["data"]]


def _pod(kube: Kube, namespace: str) -> tuple[str, int]:
    pods = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=lora")
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    statuses = pods[0]["status"].get("containerStatuses") or []
    runtime = next(s for s in statuses if s["name"] == "runtime")
    return pods[0]["metadata"]["uid"], int(runtime["restartCount"])


def _what_the_pod_says(kube: Kube, namespace: str) -> str:
    """On a timeout: the pod's own conditions and the runtime's log tail (where a condition
    write that did not land says why)."""
    pods = rest.items(kube.api, "pods", namespace, label_selector="ember.dev/instance=lora")
    lines = []
    for pod in pods:
        name = pod["metadata"]["name"]
        lines.append(f"{name}: {(pod.get('status') or {}).get('conditions')}")
        runtime = next(c for c in pod["spec"]["containers"] if c["name"] == "runtime")
        env = {e["name"]: e.get("value") for e in runtime.get("env") or []}
        lines.append(
            f"API server env: {env.get('KUBERNETES_SERVICE_HOST')}:"
            f"{env.get('KUBERNETES_SERVICE_PORT')}; pod IP {pod['status'].get('podIP')}"
        )
        log = kube.core.read_namespaced_pod_log(name, namespace, container="runtime")
        lines.append("\n".join(str(log).splitlines()[-40:]))
    return "\n".join(lines)


def _adapters_ready(kube: Kube, namespace: str, reason: str) -> dict[str, Any] | None:
    obj = rest.get(kube.api, "infd", namespace, "lora") or {}
    conditions = (obj.get("status") or {}).get("conditions") or []
    found = next((c for c in conditions if c["type"] == "AdaptersReady"), None)
    return found if found is not None and found["reason"] == reason else None


@pytest.fixture
def runtime_reports(kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The runtime's pod conditions reach the API server: the chart's runtime ClusterRole and
    admission policy (it may write its pod's ember.dev/Adapters condition, and nothing else but
    Thermal and Health), and the API server's address for a cluster without kube-proxy (as the
    e2e's chart values set it). Before the operator starts: it reads its settings then."""
    monkeypatch.setenv("EMBER_OPERATOR_RUNTIME_API_SERVER_HOST", HOST_IP)
    port = str(kube.cluster.cp.eps.apiserver)
    monkeypatch.setenv("EMBER_OPERATOR_RUNTIME_API_SERVER_PORT", port)
    with runtime_policy(kube, tmp_path):
        yield


@pytest.mark.usefixtures("runtime_reports")
def test_an_adapter_added_to_the_spec_is_served_without_a_restart(
    kube: Kube,
    namespace: str,
    operator: Any,
    runtime_image: str,  # noqa: F811 - the imported fixture
    model_dir: Path,
) -> None:
    size = (model_dir / MODEL_FILENAME).stat().st_size
    first = _adapter(model_dir, "style-a", "a.gguf")
    body = manifest(
        "lora",
        model=hostpath_model(model_dir, size),
        image=runtime_image,
        engine={"contextLength": 512, "maxBatchSize": 2, "minBatchSize": 1},
        adapters=[first],
    )
    rest.create(kube.api, "infd", namespace, body)
    wait_for("Ready", lambda: _ready_or_fail(kube, namespace, "lora"), timeout=600)
    pod = _pod(kube, namespace)
    template = (rest.get(kube.api, "deployments", namespace, "lora") or {})["spec"]["template"]
    with _port_forward(kube, "lora", namespace) as port:
        assert _models(port) == ["gemma-3-270m", "style-a"]
        base, a = _text(port, "gemma-3-270m"), _text(port, "style-a")
        assert a != base

        second = _adapter(model_dir, "style-b", "b.gguf")
        wrong = _adapter(model_dir, "wrong", "b.gguf", sha256="0" * 64)
        patch = {"spec": {"adapters": [first, second, wrong]}}
        rest.merge_patch(kube.api, "infd", namespace, "lora", patch)
        wait_for(
            "style-b served",
            lambda: _models(port) == ["gemma-3-270m", "style-a", "style-b"],
            timeout=RELOAD_TIMEOUT,
            interval=1.0,
        )
        b = _text(port, "style-b")
        assert len({base, a, b}) == 3, (base, a, b)
        refused = _complete(port, "wrong")
        assert refused.status_code == 404
        assert "sha256 mismatch" in refused.json()["error"]["message"]
        assert _text(port, "gemma-3-270m") == base  # the base serves on
        refusal = wait_for(
            "AdaptersReady: AdapterRefused",
            lambda: _adapters_ready(kube, namespace, "AdapterRefused"),
            timeout=CONDITION_TIMEOUT,
            on_fail=lambda: _what_the_pod_says(kube, namespace),
        )
        assert refusal["status"] == "False"
        assert refusal["message"].startswith("1 adapter(s) refused: wrong: sha256 mismatch")
        obj = rest.get(kube.api, "infd", namespace, "lora")
        assert rest.condition(obj, "Ready")["status"] == "True"  # Ready stays as it is

        # Removed again: 404 for its name, the others serve on.
        rest.merge_patch(kube.api, "infd", namespace, "lora", {"spec": {"adapters": [second]}})
        wait_for(
            "style-a removed",
            lambda: _models(port) == ["gemma-3-270m", "style-b"],
            timeout=RELOAD_TIMEOUT,
            interval=1.0,
        )
        assert _complete(port, "style-a").status_code == 404
        assert _text(port, "style-b") == b
        served = wait_for(
            "AdaptersReady: AdaptersServed",
            lambda: _adapters_ready(kube, namespace, "AdaptersServed"),
            timeout=CONDITION_TIMEOUT,
            on_fail=lambda: _what_the_pod_says(kube, namespace),
        )
        assert served["status"] == "True"
    # The same pod, its runtime never restarted, its template unchanged.
    assert _pod(kube, namespace) == pod
    after = (rest.get(kube.api, "deployments", namespace, "lora") or {})["spec"]["template"]
    assert after == template
    obj = rest.get(kube.api, "infd", namespace, "lora")
    assert rest.condition(obj, "Ready")["status"] == "True"
