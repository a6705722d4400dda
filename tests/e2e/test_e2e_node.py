"""End to end on the real local cluster: Helm → operator + device plugin + site gateway →
prewarm → runtime → streamed chat (through the Service, and through the gateway's one URL) →
thermal loop → an embedding deployment → uninstall. The steps are tests/e2e/flow.py's, shared
with `make demo` and `make e2e-kind`.

On failure the test output carries events, `describe` and pod logs (Flow.dumping).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.fleet import SIM_TOLERATION, ensure_fleet
from tests.conftest import Kube, NodeHandle
from tests.e2e.flow import (
    COOL_CELSIUS,
    FAKE_NPUS,
    HOT_CELSIUS,
    MODEL_DIR,
    SITE,
    SYSTEM_NS,
    Flow,
    Gateway,
)
from tests.e2e.local import local_flow
from tests.support.lora import write_lora
from tests.support.model import default_model_path, sha256_file
from tests.support.waiting import wait_for

# The first test's setup builds Ember's images: the runtime's first build compiles llama.cpp.
pytestmark = [pytest.mark.node, pytest.mark.timeout(3600)]
NAME = "gemma-e2e"
MODEL = "gemma-3-270m"  # the manifest's model.name: what clients put in `model`
LAZY, ADAPTER, OTHER = "gemma-on-demand", "gemma-on-demand-tenant-a", "gemma-other"
IDLE_SECONDS = 5  # the CRD's least


@pytest.fixture(scope="module")
def gateway(kube: Kube) -> Iterator[Gateway]:
    """The test's namespace, made before the install: the site gateway serves the
    InferenceDeployments there (its Role lives there) on the site's nodes."""
    namespace = f"e2e-{uuid.uuid4().hex[:6]}"
    kubectl = local_flow(kube.cluster).run_kubectl
    kubectl("create", "namespace", namespace)
    try:
        yield Gateway(namespace, SITE)
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def flow(node: NodeHandle, kube: Kube, gateway: Gateway) -> Iterator[Flow]:
    flow = local_flow(kube.cluster)
    flow.prepare_node()
    try:
        with flow.dumping(SYSTEM_NS):
            flow.install(flow.fake_node_values(), gateway)
        yield flow
    finally:
        flow.restore_node()


@pytest.fixture(scope="module")
def served(flow: Flow, gateway: Gateway) -> str:
    """The sample InferenceDeployment (one NPU context per replica), Ready; its namespace."""
    namespace = gateway.namespace
    with flow.dumping(namespace):
        flow.wait_npu_capacity()
        flow.apply(flow.model_manifest(NAME, namespace, npu=True))
        flow.wait_ready(NAME, namespace)
    return namespace


def test_replica_holds_its_own_acl_context(flow: Flow, served: str) -> None:
    (pod,) = flow.pods(NAME, served)
    with flow.dumping(served):
        env = flow.container_env(pod, served, "ACL_CONTEXT_ID", "ASCEND_DEVICE_ID")
    assert set(env) == {"ACL_CONTEXT_ID", "ASCEND_DEVICE_ID"}, env
    assert int(env["ACL_CONTEXT_ID"]) >= 0
    assert f"davinci{env['ASCEND_DEVICE_ID']}" in FAKE_NPUS


def test_serves_a_streamed_chat_completion(flow: Flow, served: str) -> None:
    tokens: list[str] = []
    with flow.dumping(served), flow.port_forward(NAME, served, 8080) as port:
        text = flow.chat(port, "Name one primary colour.", tokens.append)
    assert len([t for t in tokens if t]) > 3, tokens  # streamed: many chunks, not one
    assert text.strip()
    columns = flow.get_columns(NAME, served)
    assert columns["READY"] == "1/1", columns
    obj = json.loads(flow.run_kubectl("get", "infd", NAME, "-n", served, "-o", "json"))
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


def test_the_gateway_serves_the_site_at_one_url(flow: Flow, served: str, gateway: Gateway) -> None:
    """The chart's site gateway (gateway.enabled, this namespace, site edge-lab; non-root, a
    read-only root filesystem) streams a chat completion and a completion to the replica,
    lists the model, and answers a model it does not serve with OpenAI's 404."""
    chat: list[str] = []
    completion: list[str] = []
    with flow.dumping(served), flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
        models = flow.wait_gateway(port, MODEL)
        answer = flow.chat(port, "Name one primary colour.", chat.append)
        continued = flow.complete(port, "The capital of France is", completion.append)
        base = f"http://127.0.0.1:{port}"
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}
        unknown = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
    assert models == [MODEL]
    assert len([t for t in chat if t]) > 3 and answer.strip(), chat  # streamed: many chunks
    assert len([t for t in completion if t]) > 3 and continued.strip(), completion
    assert unknown.status_code == 404, unknown.text
    error = unknown.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model"), error
    assert "no-such-model" in error["message"] and error["type"], error
    assert f'ember_gateway_requests_total{{code="200",model="{MODEL}"}} 2.0' in metrics, metrics
    selector = f"app.kubernetes.io/component=gateway,ember.dev/site={SITE}"
    out = flow.run_kubectl("get", "pods", "-n", SYSTEM_NS, "-l", selector, "-o", "json")
    (pod,) = json.loads(out)["items"]
    assert pod["spec"]["nodeName"] == flow.target.node_name()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_heat_lowers_the_batch_in_kubectl_get(flow: Flow, served: str) -> None:
    with flow.dumping(served):
        hot, cool = flow.heat_and_cool(NAME, served)
    # TEMP is the runtime's smoothed reading: at 86-87 °C the batch is 8 - floor((T-78)/2) = 4.
    assert hot["BATCH"] == "4" and 86 <= int(hot["TEMP"]) <= HOT_CELSIUS, hot
    assert cool["BATCH"] == "8", cool


def test_heat_with_the_api_server_down(flow: Flow, served: str, kube: Kube) -> None:
    """The thermal loop runs on the node: with the API server stopped, heating the sensor still
    lowers the runtime's batch within 1 s (read from the pod itself, over the node's pod
    network); once the API server is back, the pod's condition and `kubectl get infd` catch up
    within 10 s."""
    (pod,) = flow.pods(NAME, served)
    ip = flow.run_kubectl("get", "pod", pod, "-n", served, "-o", "jsonpath={.status.podIP}")
    state = f"http://{ip}:8080/admin/state"
    assert httpx.get(state, timeout=5).json()["maxBatchSize"] == 8
    cp = kube.cluster.cp
    down = time.time()
    cp.procs.stop("kube-apiserver")
    try:
        assert not cp.ready()
        flow.set_temperature(HOT_CELSIUS)
        heated = time.monotonic()
        wait_for(
            "batch 4 with the API server down",
            lambda: httpx.get(state, timeout=2).json()["maxBatchSize"],
            5,
            0.02,
            until=lambda batch: batch == 4,
        )
        reaction = time.monotonic() - heated
    finally:
        cp.up()  # starts the API server again (the rest is still running) and waits for /readyz
        flow.api_outages.append((down, time.time()))
    back = time.monotonic()
    with flow.dumping(served):
        hot = flow.wait_columns(
            NAME, served, lambda c: c.get("BATCH") == "4", "BATCH 4", timeout=30, poll=0.2
        )
    caught_up = time.monotonic() - back
    print(f"offline: batch 8 -> 4 in {reaction:.2f} s; status caught up {caught_up:.1f} s later")
    assert reaction <= 1.0, f"batch 4 only after {reaction:.2f} s"
    assert caught_up <= 10.0, f"kubectl get infd caught up only after {caught_up:.1f} s"
    assert 86 <= int(hot["TEMP"]) <= HOT_CELSIUS, hot
    flow.set_temperature(COOL_CELSIUS)
    flow.wait_columns(NAME, served, lambda c: c.get("BATCH") == "8", "BATCH 8")


def test_edit_replaces_the_replica_on_a_full_node(flow: Flow, served: str) -> None:
    """An edit of a running one-replica InferenceDeployment on a node with no room for a second
    replica: the rollout must replace the pod in place. (Kubernetes' default 25 %/25 % rolls a
    one-replica Deployment with maxSurge 1: its surge pod stays Pending on a full node and the
    old pod is never replaced; the wait then fails fast on `Degraded Unschedulable`.)"""
    (old,) = flow.pods(NAME, served)
    cpu = flow.replica_cpu(NAME, served)
    with flow.dumping(served), flow.node_full_for(cpu, served):
        assert flow.free_cpu() < cpu, "the node must be full for this test to mean anything"
        edit = {"spec": {"engine": {"contextLength": 768}}}
        flow.run_kubectl(
            "patch", "infd", NAME, "-n", served, "--type=merge", "-p", json.dumps(edit)
        )
        (new,) = flow.wait_rolled(NAME, served, [old])

    def updated() -> dict[str, Any]:
        deploy = json.loads(flow.run_kubectl("get", "deploy", NAME, "-n", served, "-o", "json"))
        status: dict[str, Any] = deploy["status"]
        return status

    # The Deployment controller writes its status after the pod is Ready (a second, on a busy
    # node, after the object already shows the new pod Ready).
    wait_for(
        "the Deployment's status", updated, 30, 0.5, until=lambda s: s.get("updatedReplicas") == 1
    )
    assert new != old


def test_an_embedding_deployment_serves_embeddings_only(flow: Flow, served: str) -> None:
    """A second InferenceDeployment, model.task embed, beside the generating one: its Service
    answers /v1/embeddings and refuses chat; removed again so later steps see one replica."""
    name = f"{NAME}-embed"
    try:
        with flow.dumping(served):
            flow.apply(flow.embedding_manifest(name, served))
            flow.wait_ready(name, served)
            with flow.port_forward(name, served, 8080) as port:
                vectors = flow.embed(port, ["The cat sat on the mat.", "Name one colour."])
                refused = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}]},
                    timeout=60,
                )
        assert [len(v) for v in vectors] == [640, 640]  # Gemma 3 270M's width
        assert vectors[0] != vectors[1]
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    finally:
        flow.run_kubectl("delete", "infd", name, "-n", served, "--ignore-not-found", "--wait")


def _lora_beside_the_model() -> dict[str, Any]:
    """A generated LoRA of the test model on the node, beside the model (the local node's
    filesystem is this machine's); its `spec.adapters` entry."""
    path = MODEL_DIR / "adapters" / "tenant-a.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lora(default_model_path(), path, seed=1)
    for made in (path.parent, path):
        made.chmod(0o755 if made.is_dir() else 0o644)  # the runtime is not root
    sha = sha256_file(path)
    return {
        "name": ADAPTER,
        "path": "adapters/tenant-a.gguf",
        "sha256": sha,
        "sizeBytes": path.stat().st_size,
    }


def _lazy(flow: Flow, name: str, namespace: str, model: str, idle: int) -> dict[str, Any]:
    """A model at zero replicas that the gateway scales (0..1), a quarter of a core (as the
    embedding step's: the served replica holds the node's CPU)."""
    manifest = flow.model_manifest(name, namespace, replicas=0)
    manifest["spec"]["model"]["name"] = model
    manifest["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 1, "idleSeconds": idle}
    manifest["spec"]["resources"] = {"requests": {"cpu": "250m"}}
    return manifest


def test_models_at_zero_wake_swap_and_rest_through_the_gateway(
    flow: Flow, served: str, gateway: Gateway
) -> None:
    """Scale to zero and swapping through the chart's gateway and operator on the real node.
    Two models at zero are listed (one with its LoRA adapter). A request wakes `other` (held,
    then answered). The node is then filled so that one more quarter core does not fit: a
    request for `lazy` finds its pod Unschedulable, and the gateway scales the idle `other`
    down to make room (a swap, in its metrics); `lazy` answers, its adapter answers on the same
    replica with other text, a request that outlasts idleSeconds keeps its replica, and
    idleSeconds after it the gateway scales `lazy` back to zero."""
    name, other = f"{NAME}-lazy", f"{NAME}-other"
    manifest = _lazy(flow, name, served, LAZY, IDLE_SECONDS)
    manifest["spec"]["adapters"] = [_lora_beside_the_model()]
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    try:
        with flow.dumping(served), flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
            flow.apply(manifest)
            flow.apply(_lazy(flow, other, served, OTHER, 600))  # only a swap takes it down
            base = f"http://127.0.0.1:{port}"

            def listed() -> bool:
                models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
                return {LAZY, ADAPTER, OTHER} <= {m["id"] for m in models}

            wait_for(
                "the gateway listing the models at zero", listed, 60, 0.5, tolerate=(Exception,)
            )
            assert flow.pods(name, served) == [] and flow.pods(other, served) == []
            first = httpx.post(f"{base}/v1/completions", json={**body, "model": OTHER}, timeout=300)
            assert first.status_code == 200, first.text
            with flow.node_full_for(flow.replica_cpu(name, served), served):
                woke = httpx.post(
                    f"{base}/v1/completions", json={**body, "model": LAZY}, timeout=300
                )
                assert woke.status_code == 200, woke.text
            metrics = httpx.get(f"{base}/metrics", timeout=5).text
            assert f'ember_gateway_swaps_total{{deployment="{served}/{other}"}} 1.0' in metrics
            assert flow.pods(other, served) == []
            tuned = httpx.post(
                f"{base}/v1/completions", json={**body, "model": ADAPTER}, timeout=60
            )
            assert tuned.status_code == 200, tuned.text
            (pod,) = flow.pods(name, served)
            # A request longer than idleSeconds: the model is not scaled down under it.
            long = {**body, "model": LAZY, "max_tokens": 400, "ignore_eos": True}
            began = time.monotonic()
            streamed = httpx.post(f"{base}/v1/completions", json=long, timeout=300).json()
            lasted = time.monotonic() - began
            assert streamed["usage"]["completion_tokens"] == 400, streamed
            assert lasted > IDLE_SECONDS, f"the request lasted {lasted:.1f} s only"
            assert flow.pods(name, served) == [pod]

            def at_zero() -> bool:
                obj = json.loads(flow.run_kubectl("get", "infd", name, "-n", served, "-o", "json"))
                return obj["spec"]["replicas"] == 0 and not flow.pods(name, served)

            wait_for("the idle model back at zero", at_zero, 180, 1.0)
        texts = [r.json()["choices"][0]["text"] for r in (woke, tuned)]
        assert texts[0].strip() and texts[1].strip() and texts[0] != texts[1], texts
    finally:
        for gone in (name, other):
            flow.run_kubectl("delete", "infd", gone, "-n", served, "--ignore-not-found", "--wait")


def test_a_two_wave_rollout_through_the_chart(flow: Flow, served: str, kube: Kube) -> None:
    """spec.rollout through the Helm-installed operator: the real node's site is the canary
    (a real prewarm and runtime, which writes its own ember.dev/Health condition through the
    chart's admission policy), a kwok site the second wave. An edit reaches the canary first and
    the second site only after the canary baked."""
    ensure_fleet(kube.api, 1, sites=1)  # kwok-0, site site-0
    name = f"{NAME}-fleet"
    manifest = flow.model_manifest(name, served, replicas=2)
    manifest["spec"]["placement"] = {"sites": [SITE, "site-0"], "tolerations": [SIM_TOLERATION]}
    manifest["spec"]["resources"] = {"requests": {"cpu": "250m"}}
    manifest["spec"]["rollout"] = {
        "waves": [
            {"name": "canary", "sites": [SITE], "bakeSeconds": 10},
            {"name": "fleet", "sites": ["site-0"], "bakeSeconds": 0},
        ],
        "gate": {"readyTimeoutSeconds": 300},
    }

    def revisions() -> dict[str, str]:
        out = {}
        for site in (SITE, "site-0"):
            dep = json.loads(
                flow.run_kubectl("get", "deploy", f"{name}-{site}", "-n", served, "-o", "json")
            )
            out[site] = dep["spec"]["template"]["metadata"]["labels"]["ember.dev/revision"]
        return out

    def complete(obj: dict[str, Any]) -> bool:
        return bool((obj.get("status") or {}).get("rollout", {}).get("phase") == "Complete")

    try:
        with flow.dumping(served):
            flow.apply(manifest)
            first = flow.wait_ready(name, served, until=complete, what="rolled out")
            v1 = first["status"]["rollout"]["stableRevision"]
            assert revisions() == {SITE: v1, "site-0": v1}
            edit = {"spec": {"engine": {"maxBatchSize": 4}}}
            flow.run_kubectl(
                "patch", "infd", name, "-n", served, "--type=merge", "-p", json.dumps(edit)
            )
            seen = wait_for("the canary changes first", lambda: revisions()[SITE] != v1, 120)
            assert seen and revisions()["site-0"] == v1
            done = flow.wait_ready(
                name,
                served,
                until=lambda o: complete(o) and o["status"]["rollout"]["stableRevision"] != v1,
                what="rolled out again",
            )
        v2 = done["status"]["rollout"]["stableRevision"]
        assert revisions() == {SITE: v2, "site-0": v2}
        pods = json.loads(
            flow.run_kubectl(
                "get",
                "pods",
                "-n",
                served,
                "-l",
                f"ember.dev/instance={name},ember.dev/site-slice={SITE}",
                "-o",
                "json",
            )
        )["items"]
        health = [
            c
            for p in pods
            for c in p["status"].get("conditions", [])
            if c["type"] == "ember.dev/Health"
        ]
        assert health, "the real runtime wrote no ember.dev/Health condition"
        events = flow.run_kubectl(
            "get", "events", "-n", served, "--field-selector", f"involvedObject.name={name}"
        )
        for reason in ("RolloutStarted", "WavePassed", "RolloutComplete"):
            assert reason in events, events
    finally:
        flow.run_kubectl("delete", "infd", name, "-n", served, "--ignore-not-found", "--wait")


def test_operator_was_never_refused_by_its_rbac(flow: Flow, served: str) -> None:
    """Everything above ran through the in-cluster operator on the chart's ServiceAccount."""
    assert flow.refused_calls() == []


def test_gateway_was_never_refused_by_its_rbac(flow: Flow, served: str) -> None:
    """The gateway watched InferenceDeployments, pods and the site's Nodes on its least-privilege
    Role and ClusterRole throughout (including the API server's outage above)."""
    assert flow.refused_calls("gateway") == []


def test_helm_uninstall_leaves_nothing_behind(flow: Flow, gateway: Gateway) -> None:
    flow.uninstall()

    left = flow.leftovers(served=[gateway.namespace])
    assert not left, left
    # By design (Helm's crds/ convention, see README): CRDs outlive the release so that
    # uninstalling never deletes users' InferenceDeployments.
    assert "inferencedeployments.ember.dev" in flow.run_kubectl("get", "crd", "-o", "name")
