"""What a user sees when a model cannot be served, on the real kubelet node: the real prewarm
container (the runtime image built from this tree) and the real kubelet report, the operator
(in-process, watching this test's namespace) turns it into `Degraded`, `kubectl get infd`'s
STATUS and one Warning Event.

The cheapest place that runs the real prewarm on a real node: no Helm, no device plugin, one
small InferenceDeployment per test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from images.build import IMAGES
from tests.cluster.ember_images import build_image
from tests.conftest import Kube, NodeHandle
from tests.e2e.flow import table_columns
from tests.operator import rest
from tests.operator.specs import hostpath_model, manifest
from tests.support.model import MODEL_FILENAME, MODEL_SHA256
from tests.support.vocab_gguf import write_vocab_gguf
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]

MODELS = Path("/var/lib/ember/test-models")  # on the node, which is this machine
# Small requests: the node's two CPUs are shared with whatever else runs there.
RESOURCES = {
    "requests": {"cpu": "100m", "memory": "640Mi"},
    "limits": {"cpu": "1", "memory": "640Mi"},
}


@pytest.fixture(scope="module")
def runtime_image(node: NodeHandle) -> str:
    """The runtime image (prewarm is its init container) from this tree, on the node."""
    image = next(i for i in IMAGES if i.name == "ember-runtime")
    node.kube.cluster.node.import_image(build_image(image))
    return image.ref


@pytest.fixture
def model_dir(namespace: str) -> Iterator[Path]:
    path = MODELS / namespace
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def corrupted_copy(gemma_gguf: Path, model_dir: Path) -> tuple[Path, int, str]:
    """The real model in `model_dir` with one byte flipped: (directory, size, sha256)."""
    model_dir.mkdir(parents=True)
    data = bytearray(gemma_gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in the weights: the header still reads, the sha256 differs
    (model_dir / MODEL_FILENAME).write_bytes(data)
    for path, mode in ((model_dir, 0o755), (model_dir / MODEL_FILENAME, 0o644)):
        path.chmod(mode)  # prewarm runs as uid 65532
    return model_dir, len(data), hashlib.sha256(data).hexdigest()


def _infd(image: str, name: str, directory: Path, size: int) -> dict[str, Any]:
    return manifest(
        name,
        model=hostpath_model(directory, size),
        image=image,
        prewarm={"enabled": True, "sharedMemoryLimit": "512Mi"},
        resources=RESOURCES,
    )


def _warnings(kube: Kube, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    """The Warning Events about `name` with `reason`. Filtered by reason: on a busy node the
    replica may first wait for room (`Unschedulable`, its own Event); one per change is the
    promise, so a second Event with the same reason would still fail the test."""
    events = rest.items(kube.api, "events", namespace, field_selector=f"involvedObject.name={name}")
    return [e for e in events if e["type"] == "Warning" and e["reason"] == reason]


def _degraded_with(kube: Kube, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """Wait until `kubectl get infd` shows `reason` in its STATUS column; the object's Degraded
    condition, which must carry the same reason."""

    def status_column() -> dict[str, str] | None:
        cols = table_columns(kube.kubectl("get", "infd", name, "-n", namespace))
        return cols if cols["STATUS"] == reason else None

    wait_for(f"STATUS {reason}", status_column, timeout=240, interval=1)
    degraded = rest.true_condition(kube.api, namespace, name, "Degraded")
    assert degraded is not None and degraded["reason"] == reason, degraded
    return degraded


def test_corrupted_model_byte_shows_checksum_mismatch(
    kube: Kube,
    namespace: str,
    operator: Any,
    runtime_image: str,
    corrupted_copy: tuple[Path, int, str],
) -> None:
    model_dir, size, got = corrupted_copy
    rest.create(kube.api, "infd", namespace, _infd(runtime_image, "corrupt", model_dir, size))
    degraded = _degraded_with(kube, namespace, "corrupt", "ChecksumMismatch")
    detail = f"{MODEL_FILENAME} expected {MODEL_SHA256[:12]}… got {got[:12]}…"
    assert degraded["message"].endswith(detail), degraded
    described = kube.kubectl("describe", "infd", "corrupt", "-n", namespace)
    assert f"expected {MODEL_SHA256[:12]}… got {got[:12]}…" in described
    events = wait_for(
        "a Warning Event", lambda: _warnings(kube, namespace, "corrupt", "ChecksumMismatch")
    )
    assert len(events) == 1, json.dumps(events, indent=1)
    (event,) = events
    assert event["reason"] == "ChecksumMismatch" and detail in event["message"]


@pytest.fixture
def foreign_draft(gemma_gguf: Path, model_dir: Path) -> tuple[Path, int]:
    """The real model in `model_dir` beside draft.gguf, a vocabulary that is not Gemma's:
    (directory, the model's size)."""
    model_dir.mkdir(parents=True)
    shutil.copyfile(gemma_gguf, model_dir / MODEL_FILENAME)
    draft = write_vocab_gguf(model_dir / "draft.gguf")
    for path, mode in ((model_dir, 0o755), (model_dir / MODEL_FILENAME, 0o644), (draft, 0o644)):
        path.chmod(mode)  # prewarm runs as uid 65532
    return model_dir, gemma_gguf.stat().st_size


def test_a_draft_model_of_another_vocabulary_shows_draft_vocabulary_mismatch(
    kube: Kube, namespace: str, operator: Any, runtime_image: str, foreign_draft: tuple[Path, int]
) -> None:
    """engine.draftModel naming a model whose vocabulary is not Gemma's: the real prewarm
    refuses it before copying (its preflight), and the object says why."""
    model_dir, model_size = foreign_draft
    draft = model_dir / "draft.gguf"
    obj = _infd(runtime_image, "drafted", model_dir, model_size)
    size, sha = draft.stat().st_size, hashlib.sha256(draft.read_bytes()).hexdigest()
    obj["spec"]["model"]["files"].append({"path": "draft.gguf", "sha256": sha, "sizeBytes": size})
    obj["spec"]["engine"] = {"draftModel": "draft.gguf"}
    rest.create(kube.api, "infd", namespace, obj)
    degraded = _degraded_with(kube, namespace, "drafted", "DraftVocabularyMismatch")
    detail = f"draft.gguf has another vocabulary than {MODEL_FILENAME}: vocabulary size 10"
    assert detail in degraded["message"], degraded


def test_missing_model_directory_shows_the_kubelets_mount_failure(
    kube: Kube, namespace: str, operator: Any, runtime_image: str, model_dir: Path
) -> None:
    """A hostPath that does not exist on the node: the pod waits in ContainerCreating forever
    and only a kubelet Event says why; the InferenceDeployment must say it too."""
    assert not model_dir.exists()
    rest.create(kube.api, "infd", namespace, _infd(runtime_image, "nodir", model_dir, 1 << 20))
    degraded = wait_for(
        "Degraded FailedMount",
        lambda: (
            (d := rest.true_condition(kube.api, namespace, "nodir", "Degraded"))
            and d["reason"] == "FailedMount"
            and d
        ),
        timeout=120,
        interval=1,
    )
    # The kubelet's own words, naming the volume and the missing path.
    assert '"model"' in degraded["message"] and str(model_dir) in degraded["message"], degraded
    cols = table_columns(kube.kubectl("get", "infd", "nodir", "-n", namespace))
    assert cols["STATUS"] == "FailedMount", cols
    events = wait_for("a Warning Event", lambda: _warnings(kube, namespace, "nodir", "FailedMount"))
    assert len(events) == 1, json.dumps(events, indent=1)
    (event,) = events
    assert event["reason"] == "FailedMount", json.dumps(event)
