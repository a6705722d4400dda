"""An `http` model source on the real kubelet node: nobody places a file by hand. A Range-honouring
origin on this machine serves the packaged Gemma GGUF; the real node agent (a process on the
node, which is this machine, with the chart's RBAC and a token of its ServiceAccount) sees the
pod scheduled there and fills the node cache; the real prewarm container (the runtime image
built from this tree) waits for it, verifies and copies. A wrong sha256 becomes
`ChecksumMismatch` on the InferenceDeployment and leaves nothing in the cache.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.control_plane import NODE_NAME
from tests.conftest import Kube
from tests.e2e.flow import table_columns
from tests.nodeagent.origin import OriginState, serve
from tests.operator import rest
from tests.operator.specs import manifest
from tests.operator.test_reasons_node import RESOURCES, runtime_image  # noqa: F401 - fixture
from tests.support.model import MODEL_FILENAME, MODEL_SHA256
from tests.support.waiting import wait_for
from tests.thermal.kube_support import NODEAGENT_TEMPLATES, chart_objects, kubectl_apply, token_dir

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]

CACHE = Path("/var/lib/ember/cache")  # the operator's default node_cache_root, on this node
WRONG = "0" * 64
ROOT = Path(__file__).resolve().parents[2]
EMBER_PODS = "app.kubernetes.io/managed-by=ember-operator"
SLOW_RATE = 2_000_000  # bytes/s: the packaged model (~253 MB) takes ~2 minutes
RESUME_RATE = 8_000_000  # bytes/s: a third of it in ~10 s, then the agent is killed


def _forget(sha: str) -> None:
    """The node holds nothing of `sha`: the blob, its partial, its failure, and its view (a
    hard link to an earlier test's verified blob would let prewarm finish at once)."""
    for path in (CACHE / "sha256" / sha, CACHE / "sha256" / f"{sha}.partial"):
        path.unlink(missing_ok=True)
    (CACHE / "failed" / sha).unlink(missing_ok=True)
    shutil.rmtree(CACHE / "views" / sha, ignore_errors=True)


@pytest.fixture
def origin(gemma_gguf: Path) -> Iterator[tuple[str, OriginState]]:
    with serve({MODEL_FILENAME: gemma_gguf.read_bytes()}) as served:
        yield served


@pytest.fixture
def agent(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The node agent as a process on the node, with the chart's RBAC in `namespace` (its own)."""
    with _running_agent(kube, namespace, tmp_path) as proc:
        yield proc


@pytest.fixture
def slow_agent(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The agent pacing origin downloads at SLOW_RATE (its maxBandwidth)."""
    with _running_agent(
        kube, namespace, tmp_path, [f"--origin_max_bytes_per_second={SLOW_RATE}"]
    ) as proc:
        yield proc


@contextmanager
def _running_agent(
    kube: Kube, namespace: str, tmp_path: Path, extra: Sequence[str] = ()
) -> Iterator[subprocess.Popen[str]]:
    objects = [
        o
        for o in chart_objects(*NODEAGENT_TEMPLATES, namespace=namespace)
        if o["kind"] != "DaemonSet"
    ]
    kubectl_apply(kube, objects, tmp_path)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    )
    answer: Any = kube.core.create_namespaced_service_account_token(
        "ember-nodeagent", namespace, request
    )
    sa = token_dir(kube, str(answer.status.token), tmp_path / "sa")
    (tmp_path / "sys").mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}/runtime:{ROOT}"}
    argv = [
        sys.executable,
        "-m",
        "ember_runtime.nodeagent",
        f"--node_name={NODE_NAME}",
        f"--server={kube.api.configuration.host}",
        f"--token_file={sa / 'token'}",
        f"--ca_file={sa / 'ca.crt'}",
        f"--cache_root={CACHE}",
        f"--namespace={namespace}",
        f"--sysfs_root={tmp_path / 'sys'}",
        "--interval_seconds=60",
        *extra,
    ]
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        # Started: it logs this once its signal handlers are in (the cache directory may be
        # left from an earlier agent, so its existence says nothing about this one).
        wait_for(
            "the node agent to start",
            lambda: proc.poll() is not None or "keeping models for" in log_path.read_text(),
            timeout=30,
        )
        assert proc.poll() is None, log_path.read_text()
        yield proc
    finally:
        alive = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        for o in objects:
            if "namespace" not in o["metadata"]:
                kube.kubectl(
                    "delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found"
                )
    print(log_path.read_text())
    assert not alive or code == 0, log_path.read_text()  # SIGTERM stops it cleanly


World = tuple[str, str, OriginState]  # runtime image, origin URL, origin state


@pytest.fixture
def quiet_node(kube: Kube, namespace: str) -> None:
    """Wait for earlier tests' Ember pods (their namespaces still terminating) to leave the
    node: the agent serves every pod on its node, and a leftover one would start a download or
    take the node's CPU and memory from this test's replica."""

    def others() -> list[str]:
        query = [("labelSelector", EMBER_PODS), ("fieldSelector", f"spec.nodeName={NODE_NAME}")]
        pods = rest.request(kube.api, "GET", "/api/v1/pods", query=query).get("items") or []
        names = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods]
        return [f"{ns}/{name}" for ns, name in names if ns != namespace]

    wait_for("earlier tests' pods to leave the node", lambda: not others() or None, timeout=180)


@pytest.fixture
def agentless_world(
    quiet_node: None,
    operator: Any,
    runtime_image: str,  # noqa: F811 - the imported fixture
    origin: tuple[str, OriginState],
) -> World:
    """The operator, the runtime image on the node and the origin, with no agent yet (a test
    that starts and kills its own uses this one)."""
    return runtime_image, *origin


@pytest.fixture
def world(agentless_world: World, agent: subprocess.Popen[str]) -> World:
    """As `agentless_world`, with the node agent running."""
    return agentless_world


@pytest.fixture
def slow_world(agentless_world: World, slow_agent: subprocess.Popen[str]) -> World:
    """As `world`, with the agent pacing the origin at SLOW_RATE."""
    return agentless_world


def _infd(image: str, name: str, url: str, sha: str, size: int) -> dict[str, Any]:
    """An http-sourced replica that fits RESOURCES' 640 Mi: the default engine (16 sequences of
    2,048 tokens) needs 961 MiB and would stop with EngineMemoryOverLimit once prewarm is done."""
    return manifest(
        name,
        model={
            "name": "gemma-3-270m",
            "format": "gguf",
            "source": {"http": {"urls": {MODEL_FILENAME: url}}},
            "files": [{"path": MODEL_FILENAME, "sha256": sha, "sizeBytes": size}],
        },
        image=image,
        prewarm={"enabled": True, "sharedMemoryLimit": "512Mi"},
        engine={"contextLength": 512, "maxBatchSize": 2, "minBatchSize": 1},
        resources=RESOURCES,
    )


def _explain(kube: Kube, namespace: str, degraded: Mapping[str, Any]) -> str:
    """What a timed-out wait prints: the condition, the pods' container states, the events."""
    pods = kube.kubectl("get", "pods", "-n", namespace, "-o", "yaml")
    events = kube.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp")
    return f"Degraded: {degraded}\n--- pods ---\n{pods}\n--- events ---\n{events}"


def _prewarm_state(kube: Kube, namespace: str) -> dict[str, Any] | None:
    for pod in rest.items(kube.api, "pods", namespace):
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated")
            if status["name"] == "prewarm" and terminated:
                return dict(terminated)
    return None


def test_http_source_reaches_prewarm_success_with_no_file_placed_by_hand(
    kube: Kube, namespace: str, gemma_gguf: Path, world: World
) -> None:
    image, base, state = world
    _forget(MODEL_SHA256)
    size = gemma_gguf.stat().st_size
    url = f"{base}/{MODEL_FILENAME}"
    try:
        rest.create(kube.api, "infd", namespace, _infd(image, "http", url, MODEL_SHA256, size))
        done = wait_for(
            "prewarm to finish", lambda: _prewarm_state(kube, namespace), timeout=600, interval=2
        )
        assert done["exitCode"] == 0, done
        assert (CACHE / "sha256" / MODEL_SHA256).stat().st_size == size
        assert state.bytes_sent == size  # one download, nothing fetched twice
    finally:
        _forget(MODEL_SHA256)
        _forget(WRONG)


def test_wrong_sha256_shows_checksum_mismatch_and_caches_nothing(
    kube: Kube, namespace: str, gemma_gguf: Path, world: World
) -> None:
    image, base, _ = world
    _forget(WRONG)
    size = gemma_gguf.stat().st_size
    try:
        infd = _infd(image, "wrong", f"{base}/{MODEL_FILENAME}", WRONG, size)
        rest.create(kube.api, "infd", namespace, infd)

        def status_column() -> dict[str, str] | None:
            cols = table_columns(kube.kubectl("get", "infd", "wrong", "-n", namespace))
            return cols if cols["STATUS"] == "ChecksumMismatch" else None

        wait_for("STATUS ChecksumMismatch", status_column, timeout=600, interval=2)
        assert not (CACHE / "sha256" / WRONG).exists()
        assert not (CACHE / "sha256" / f"{WRONG}.partial").exists()
        described = kube.kubectl("describe", "infd", "wrong", "-n", namespace)
        assert f"expected {WRONG[:12]}… got {MODEL_SHA256[:12]}…" in described, described
    finally:
        # The agent watches every pod on the node: an earlier test's pod, still terminating,
        # may have had it start on that model too.
        _forget(WRONG)
        _forget(MODEL_SHA256)


def test_a_slow_download_shows_the_nodes_bytes_and_eta_then_serves(
    kube: Kube, namespace: str, gemma_gguf: Path, slow_world: World, operator: Any
) -> None:
    """The whole progress path on the real node: the agent downloads at 2 MB/s and reports
    the waiting pod's progress on it (ember.dev/ModelDownload) at once and every 30 s; the
    operator shows it as STATUS and in `describe` while the real prewarm container waits,
    without restarting; prewarm then copies, and the replica stops being Degraded."""
    image, base, state = slow_world
    _forget(MODEL_SHA256)
    size = gemma_gguf.stat().st_size
    url = f"{base}/{MODEL_FILENAME}"
    try:
        rest.create(kube.api, "infd", namespace, _infd(image, "slow", url, MODEL_SHA256, size))

        def condition(kind: str) -> dict[str, Any]:
            return rest.condition(rest.get(kube.api, "infd", namespace, "slow"), kind)

        def degraded() -> dict[str, Any]:
            return condition("Degraded")

        def serving() -> bool:
            # Both at once: a replica that starts and then fails is briefly neither Degraded
            # nor Ready, and must not pass for a recovered one.
            ready = condition("Ready").get("status") == "True"
            return ready and degraded().get("status") == "False"

        cond = wait_for(
            "ModelDownloading",
            lambda: (c := degraded()).get("reason") == "ModelDownloading" and c,
            timeout=300,
            interval=2,
        )
        message = cond["message"]
        assert message.startswith(f"1 node waits for the model: {NODE_NAME}: "), message
        assert f" of {size / 1e6:.1f} MB in the node cache, ETA " in message, message
        # The agent's next report, 30 s on, has a rate over the wait so far.
        later = wait_for(
            "a report with a rate",
            lambda: re.search(r"B/s over [0-9hms]+\)", m := degraded().get("message", "")) and m,
            timeout=60,
            interval=2,
        )
        assert "ETA unknown" not in later, later
        cols = table_columns(kube.kubectl("get", "infd", "slow", "-n", namespace))
        assert cols["STATUS"] == "ModelDownloading"
        described = kube.kubectl("describe", "infd", "slow", "-n", namespace)
        assert f"{NODE_NAME}: " in described and "ETA" in described, described
        # The download finishes; the restarted prewarm copies and exits 0, the runtime serves,
        # and the old ModelDownloading exit in prewarm's lastState no longer makes the replica
        # Degraded.
        try:
            wait_for(
                "the replica to serve, no longer Degraded",
                serving,
                timeout=600,
                interval=2,
            )
        except AssertionError:
            print(_explain(kube, namespace, degraded()), "--- operator ---", operator.output)
            raise
        assert state.bytes_sent == size  # one download, nothing fetched twice
    finally:
        _forget(MODEL_SHA256)


def test_an_agent_killed_mid_download_resumes_where_it_stopped(
    kube: Kube, namespace: str, gemma_gguf: Path, tmp_path: Path, agentless_world: World
) -> None:
    """The agent is SIGKILLed with a third of the model in its `.partial`; the next agent (a
    restarted DaemonSet pod) asks the origin for the rest only, and the replica's prewarm gets
    the verified file: the origin sends one copy, give or take what was in flight."""
    image, base, state = agentless_world
    _forget(MODEL_SHA256)
    size = gemma_gguf.stat().st_size
    partial = CACHE / "sha256" / f"{MODEL_SHA256}.partial"
    url = f"{base}/{MODEL_FILENAME}"
    try:
        rest.create(kube.api, "infd", namespace, _infd(image, "resume", url, MODEL_SHA256, size))
        first_dir, second_dir = tmp_path / "first", tmp_path / "second"
        first_dir.mkdir()
        second_dir.mkdir()
        paced = [f"--origin_max_bytes_per_second={RESUME_RATE}"]
        with _running_agent(kube, namespace, first_dir, paced) as first:
            wait_for(
                "a third of the model in the partial",
                lambda: partial.exists() and partial.stat().st_size >= size // 3,
                timeout=300,
                interval=0.5,
            )
            first.kill()  # SIGKILL: no clean-up of any kind
            first.wait(timeout=30)
        cut = partial.stat().st_size
        assert cut < size, cut
        with _running_agent(kube, namespace, second_dir):
            done = wait_for(
                "prewarm to finish",
                lambda: (s := _prewarm_state(kube, namespace)) and s["exitCode"] == 0 and s,
                timeout=600,
                interval=2,
            )
        assert (CACHE / "sha256" / MODEL_SHA256).stat().st_size == size
        assert size <= state.bytes_sent <= 1.05 * size, (cut, state.bytes_sent, done)
        ranges = [r["range"] for r in state.requests if r.get("range")]
        assert ranges and int(ranges[-1].removeprefix("bytes=").rstrip("-")) > 0, state.requests
    finally:
        _forget(MODEL_SHA256)
