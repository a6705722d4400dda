"""Bad input, proven on the real API server: (manifest change, expected message) rows.

Every CEL rule has a rejecting row and an accepting row. Objects are sent with server-side dry
run and strict field validation (what `kubectl apply` does), so nothing needs cleaning up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.operator.specs import SHA, manifest, set_path

pytestmark = pytest.mark.cluster

Doc = dict[str, Any]
Change = Callable[[Doc], Doc]


def path(dotted: str, value: Any) -> Change:
    return lambda doc: set_path(doc, dotted, value)


def spec(**overrides: Any) -> Change:
    return lambda doc: manifest(doc["metadata"]["name"], **overrides)


def spec_yaml(text: str) -> Change:
    """Spec keys as a person types them: YAML 1.1, as kubectl reads it (a bare off is false)."""
    return spec(**yaml.safe_load(text))


HOST = {"hostPath": {"path": "/models"}}
HTTP = {"http": {"urls": {"gemma.gguf": "https://models.example/gemma.gguf"}}}


ADAPTER = {"name": "gemma-sql", "path": "adapters/sql.gguf", "sha256": SHA, "sizeBytes": 10}
HTTP_ADAPTER = {**ADAPTER, "url": "https://models.example/sql.gguf"}


def http_url(url: str) -> Change:
    return path("spec.model.source", {"http": {"urls": {"gemma.gguf": url}}})


MODEL = manifest()["spec"]["model"]
WITH_DRAFT = {  # engine.draftModel names a second file of the model
    **MODEL,
    "files": [*MODEL["files"], {"path": "draft.gguf", "sha256": SHA, "sizeBytes": 10}],
}
TRT_MODEL = {
    **MODEL,
    "format": "trtllm-engine",
    "files": [{"path": "rank0.engine", "sha256": SHA, "sizeBytes": 10}],
}
TRT = {
    "model": TRT_MODEL,
    "engine": {"kind": "tensorrt-llm"},
    "accelerator": {"kind": "nvidia-gpu"},
}

REJECT: list[tuple[str, Change, str]] = [
    ("missing-model", path("spec.model", None), "spec.model: Required value"),
    ("missing-spec", path("spec", None), "spec: Required value"),
    (
        "two-sources",
        path("spec.model.source", {**HOST, "pvc": {"claimName": "m"}}),
        "model.source must set exactly one of hostPath, pvc, image or http",
    ),
    (
        "no-source",
        path("spec.model.source", {}),
        "model.source must set exactly one of hostPath, pvc, image or http",
    ),
    (
        "bad-sha256",
        path("spec.model.files.0.sha256", "abc123"),
        "sha256 must be exactly 64 lowercase hexadecimal",
    ),
    (
        "upper-sha256",
        path("spec.model.files.0.sha256", SHA.upper()),
        "sha256 must be exactly 64 lowercase hexadecimal",
    ),
    (
        "dotdot-path",
        path("spec.model.files.0.path", "../etc/passwd.gguf"),
        "relative path without '..'",
    ),
    ("absolute-path", path("spec.model.files.0.path", "/etc/m.gguf"), "relative path without '..'"),
    ("no-files", path("spec.model.files", []), "spec.model.files: Invalid value"),
    (
        "gguf-without-gguf-file",
        path("spec.model.files.0.path", "model.bin"),
        "at least one file ending in .gguf",
    ),
    (
        "relative-hostpath",
        path("spec.model.source", {"hostPath": {"path": "models"}}),
        "hostPath.path must be an absolute path",
    ),
    (
        "pvc-subpath-dotdot",
        path("spec.model.source", {"pvc": {"claimName": "m", "subPath": "a/../../b"}}),
        "subPath must be relative",
    ),
    (
        "http-and-hostpath",
        path("spec.model.source", {**HOST, **HTTP}),
        "model.source must set exactly one of hostPath, pvc, image or http",
    ),
    ("http-ftp-url", http_url("ftp://models.example/gemma.gguf"), "must be http:// or https://"),
    ("http-no-host", http_url("https:///gemma.gguf"), "must be http:// or https://"),
    ("http-userinfo", http_url("https://u:p@models.example/g.gguf"), "no user info"),
    ("http-not-a-url", http_url("gemma.gguf"), "must be http:// or https://"),
    ("http-url-too-long", http_url("https://h/" + "a" * 2048), "Too long"),
    (
        "http-file-without-url",
        path("spec.model.source", {"http": {"urls": {"other.gguf": "https://h/o.gguf"}}}),
        "must have a URL for every path in model.files",
    ),
    (
        "http-url-for-unknown-file",
        path(
            "spec.model.source",
            {"http": {"urls": {"gemma.gguf": "https://h/g", "extra.bin": "https://h/e"}}},
        ),
        "may only name paths listed in model.files",
    ),
    ("http-no-urls", path("spec.model.source", {"http": {"urls": {}}}), "spec.model.source.http"),
    (
        "http-bad-secret-name",
        path("spec.model.source", {"http": {**HTTP["http"], "secretRef": {"name": "Hf_Token"}}}),
        "secretRef.name must be a Secret name",
    ),
    (
        "http-without-prewarm",
        spec(model={**MODEL, "source": HTTP}, prewarm={"enabled": False}),
        "model.source.http requires prewarm.enabled",
    ),
    (
        "min-over-max-batch",
        spec(engine={"minBatchSize": 32, "maxBatchSize": 16}),
        "minBatchSize must be less than or equal to engine.maxBatchSize",
    ),
    (
        "min-over-default-max",
        spec(engine={"minBatchSize": 17}),
        "minBatchSize must be less than or equal to engine.maxBatchSize",
    ),
    (
        "max-batch-too-big",
        spec(engine={"maxBatchSize": 300}),
        "should be less than or equal to 256",
    ),
    (
        "critical-equals-throttle",
        spec(thermal={"throttleCelsius": 80, "criticalCelsius": 80}),
        "criticalCelsius must be greater than thermal.throttleCelsius",
    ),
    (
        "critical-below-default-throttle",
        spec(thermal={"criticalCelsius": 70}),
        "criticalCelsius must be greater than thermal.throttleCelsius",
    ),
    (
        "tensorrt-on-cpu",
        spec(model=TRT_MODEL, engine={"kind": "tensorrt-llm"}),
        "tensorrt-llm requires accelerator.kind nvidia-gpu",
    ),
    (
        "trt-engine-on-llamacpp",
        spec(model=TRT_MODEL),
        "trtllm-engine requires engine.kind tensorrt-llm",
    ),
    (
        "gguf-on-tensorrt",
        spec(engine={"kind": "tensorrt-llm"}, accelerator={"kind": "nvidia-gpu"}),
        "model.format gguf requires engine.kind llamacpp",
    ),
    (
        "threads-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "threads": 4}}),
        "engine.threads only applies to the llamacpp engine",
    ),
    (
        "gpu-layers-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "gpuLayers": 4}}),
        "engine.gpuLayers only applies to the llamacpp engine",
    ),
    (
        "gpu-layers-on-cpu",
        spec(engine={"gpuLayers": 4}),
        "engine.gpuLayers above 0 requires accelerator.kind nvidia-gpu",
    ),
    (
        "speculation-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "speculation": {"maxDraft": 4}}}),
        "engine.speculation only applies to the llamacpp engine",
    ),
    (
        "speculation-ngrams-reversed",
        spec(engine={"speculation": {"ngramMin": 6}}),
        "engine.speculation.ngramMin must be less than or equal to ngramMax",
    ),
    ("speculation-draft-zero", spec(engine={"speculation": {"maxDraft": 0}}), "maxDraft"),
    (
        "draft-model-not-a-file",
        spec(model=WITH_DRAFT, engine={"draftModel": "other.gguf"}),
        "engine.draftModel must be the path of a .gguf file in model.files other than the first",
    ),
    (
        "draft-model-is-the-served-model",
        spec(model=WITH_DRAFT, engine={"draftModel": "gemma.gguf"}),
        "engine.draftModel must be the path of a .gguf file in model.files other than the first",
    ),
    (
        "draft-model-with-speculation-off",
        spec(model=WITH_DRAFT, engine={"draftModel": "draft.gguf", "speculation": {"mode": "off"}}),
        "engine.draftModel requires engine.kind llamacpp, model.task generate and speculation on",
    ),
    (
        "draft-model-deterministic",
        spec(model=WITH_DRAFT, engine={"draftModel": "draft.gguf", "deterministic": True}),
        "engine.draftModel requires engine.kind llamacpp, model.task generate and speculation on",
    ),
    (
        "sampling-top-k-on-tensorrt",
        spec(**{**TRT, "sampling": {"temperature": 0.7, "topK": 40}}),
        "sampling.topK, minP and repeatPenalty require engine.kind llamacpp",
    ),
    (
        "sampling-on-embed",
        spec(model={**MODEL, "task": "embed"}, sampling={"temperature": 0.5}),
        "sampling applies to model.task generate only",
    ),
    ("sampling-top-p-zero", spec(sampling={"topP": 0}), "spec.sampling.topP: Invalid value"),
    ("sampling-hot", spec(sampling={"temperature": 2.5}), "spec.sampling.temperature"),
    ("sampling-unknown-field", spec(sampling={"top_k": 40}), 'unknown field "spec.sampling.top_k"'),
    (
        "deterministic-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "deterministic": True}}),
        "engine.deterministic only applies to the llamacpp engine",
    ),
    (
        "deterministic-not-a-bool",
        spec(engine={"deterministic": "yes"}),
        "spec.engine.deterministic: Invalid value",
    ),
    (
        "gpu-count-zero",
        spec(accelerator={"kind": "npu", "count": 0}),
        "accelerator.count must be at least 1",
    ),
    (
        "negative-replicas",
        spec(replicas=-1),
        "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or "
        "equal to 0",
    ),
    ("port-out-of-range", spec(server={"port": 70000}), "should be less than or equal to 65535"),
    ("privileged-port", spec(server={"port": 80}), "should be greater than or equal to 1024"),
    (
        "unknown-engine",
        spec(engine={"kind": "vllm"}),
        'Unsupported value: "vllm": supported values: "llamacpp", "tensorrt-llm"',
    ),
    ("unknown-accelerator", spec(accelerator={"kind": "tpu"}), 'Unsupported value: "tpu"'),
    (
        "unknown-format",
        path("spec.model.format", "safetensors"),
        'Unsupported value: "safetensors"',
    ),
    ("unknown-thermal-policy", spec(thermal={"policy": "panic"}), 'Unsupported value: "panic"'),
    (  # YAML's bare off is the boolean false: refused (never taken for "off"), naming static
        "thermal-policy-bare-off",
        spec_yaml("thermal: {policy: off}"),
        'supported values: "adaptive", "static", "off"',
    ),
    (
        "bad-quantity",
        spec(prewarm={"sharedMemoryLimit": "lots"}),
        "sharedMemoryLimit in body should match",
    ),
    (
        "unknown-field",
        path("spec.engine", {"kind": "llamacpp", "turbo": True}),
        'unknown field "spec.engine.turbo"',
    ),
    (
        "name-too-long",
        path("metadata.name", "a" * 57),
        "metadata.name must be a lowercase DNS label of at most 56",
    ),
    ("duplicate-sites", spec(placement={"sites": ["a", "a"]}), "Duplicate value"),
    (
        "resource-name-with-space",
        spec(resources={"requests": {"cpu ": "1"}}),
        "resources.requests keys must be resource names such as cpu, memory or nvidia.com/gpu",
    ),
    (
        "resource-name-empty-after-prefix",
        spec(resources={"limits": {"nvidia.com/": 1}}),
        "resources.limits keys must be resource names",
    ),
    (
        "resource-name-upper-case-prefix",
        spec(resources={"limits": {"Ember.dev/npu": 1}}),
        "resources.limits keys must be resource names",
    ),
    (
        "resource-name-too-long",
        spec(resources={"requests": {"example.com/" + "a" * 64: 1}}),
        "resources.requests keys must be resource names",
    ),
    (
        "too-many-resources",
        spec(resources={"requests": {f"example.com/r{i}": 1 for i in range(17)}}),
        "must have at most 16 items",
    ),
    (
        "pooling-without-embed",
        path("spec.model.pooling", "mean"),
        "model.pooling only applies to model.task embed",
    ),
    (
        "embed-on-tensorrt",
        spec(**{**TRT, "model": {**TRT_MODEL, "task": "embed"}}),
        "model.task embed requires engine.kind llamacpp",
    ),
    (
        "pooling-none",  # one vector per input, or /v1/embeddings cannot answer
        path("spec.model", {**MODEL, "task": "embed", "pooling": "none"}),
        'Unsupported value: "none": supported values: "mean", "cls", "last"',
    ),
    ("unknown-task", path("spec.model.task", "rerank"), 'Unsupported value: "rerank"'),
    (
        "adapter-named-as-base",
        spec(adapters=[{**ADAPTER, "name": MODEL["name"]}]),
        "adapters[].name must differ from model.name",
    ),
    (
        "adapter-duplicate-name",
        spec(adapters=[ADAPTER, {**ADAPTER, "path": "b.gguf"}]),
        "Duplicate value",
    ),
    ("adapter-name-space", spec(adapters=[{**ADAPTER, "name": "a b"}]), "must not contain white"),
    ("adapter-bad-sha", spec(adapters=[{**ADAPTER, "sha256": "x"}]), "adapters[].sha256 must be"),
    ("adapter-escapes", spec(adapters=[{**ADAPTER, "path": "../x.gguf"}]), "without '..'"),
    ("adapter-url-on-hostpath", spec(adapters=[HTTP_ADAPTER]), "adapters[].url is required"),
    (
        "adapter-no-url-on-http",
        spec(adapters=[ADAPTER], model={**MODEL, "source": HTTP}, prewarm={"enabled": True}),
        "adapters[].url is required",
    ),
    (
        "adapter-on-embedder",
        spec(adapters=[ADAPTER], model={**MODEL, "task": "embed"}),
        "adapters require engine.kind llamacpp and model.task generate",
    ),
    (
        "scaling-min-above-max",
        spec(scaling={"minReplicas": 3, "maxReplicas": 2}),
        "scaling.minReplicas must be less than or equal to scaling.maxReplicas",
    ),
    ("scaling-zero-max", spec(scaling={"maxReplicas": 0}), "greater than or equal to 1"),
    (
        "scaling-with-rollout",
        spec(scaling={}, rollout={"waves": [{"name": "all", "percent": 100}]}),
        "scaling and rollout cannot be combined",
    ),
]

ACCEPT: list[tuple[str, Change]] = [
    ("minimal", lambda doc: doc),
    (
        "resource-names",
        spec(
            resources={
                "requests": {"cpu": "1", "memory": "1Gi", "hugepages-2Mi": "2Mi"},
                "limits": {"memory": "2Gi", "nvidia.com/gpu": 1, "ember.dev/npu": 1},
            }
        ),
    ),
    (  # the longest resource name Kubernetes allows: a 253-character prefix, a 63-character name
        "resource-name-longest",
        spec(resources={"limits": {".".join(["a" * 63] * 4)[:253] + "/" + "b" * 63: 1}}),
    ),
    ("pvc-source", path("spec.model.source", {"pvc": {"claimName": "m", "subPath": "gemma/v1"}})),
    ("image-source", path("spec.model.source", {"image": {"reference": "registry/models:gemma"}})),
    ("http-source", path("spec.model.source", HTTP)),
    ("http-plain-with-port", http_url("http://10.0.0.5:8080/m/gemma.gguf?sig=a@b")),
    (
        "http-with-secret",
        path("spec.model.source", {"http": {**HTTP["http"], "secretRef": {"name": "hf.token"}}}),
    ),
    ("nested-relative-path", path("spec.model.files.0.path", "sub/dir/model..v1.gguf")),
    ("min-equals-max-batch", spec(engine={"minBatchSize": 16, "maxBatchSize": 16})),
    ("critical-just-above", spec(thermal={"throttleCelsius": 80, "criticalCelsius": 81})),
    ("thermal-policy-static", spec_yaml("thermal: {policy: static}")),
    ("thermal-policy-off-quoted", spec_yaml('thermal: {policy: "off"}')),
    ("tensorrt-on-gpu", spec(**TRT)),
    ("npu-with-count", spec(accelerator={"kind": "npu", "count": 2})),
    ("cpu-count-zero", spec(accelerator={"kind": "cpu", "count": 0})),
    ("threads-on-llamacpp", spec(engine={"threads": 2})),
    ("gpu-layers-on-gpu", spec(engine={"gpuLayers": 20}, accelerator={"kind": "nvidia-gpu"})),
    ("no-gpu-layers-on-cpu", spec(engine={"gpuLayers": 0})),
    ("deterministic-on-llamacpp", spec(engine={"deterministic": True})),
    (
        "not-deterministic-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "deterministic": False}}),
    ),
    ("zero-replicas", spec(replicas=0)),
    ("name-56", path("metadata.name", "a" * 56)),
    ("integer-quantity", spec(prewarm={"sharedMemoryLimit": 1073741824})),
    ("embed-pooling-from-the-gguf", path("spec.model.task", "embed")),
    ("embed-with-pooling", path("spec.model", {**MODEL, "task": "embed", "pooling": "cls"})),
    ("generate-explicitly", path("spec.model.task", "generate")),
    ("adapters-hostpath", spec(adapters=[ADAPTER, {**ADAPTER, "name": "b", "scale": 0.5}])),
    (
        "adapters-http",
        spec(adapters=[HTTP_ADAPTER], model={**MODEL, "source": HTTP}, prewarm={"enabled": True}),
    ),
    ("scaling-defaults", spec(scaling={})),
    ("speculation-defaults", spec(engine={"speculation": {}})),
    (
        "speculation-off-on-tensorrt",
        spec(**{**TRT, "engine": {"kind": "tensorrt-llm", "speculation": {"mode": "off"}}}),
    ),
    ("speculation-tuned", spec(engine={"speculation": {"maxDraft": 16, "ngramMax": 8}})),
    ("draft-model", spec(model=WITH_DRAFT, engine={"draftModel": "draft.gguf"})),
    ("scaling-bounds", spec(scaling={"minReplicas": 1, "maxReplicas": 4, "priority": -5})),
    (
        "sampling-like-llama-server",
        spec(sampling={"temperature": 0.8, "topP": 0.95, "topK": 40, "minP": 0.05}),
    ),
    ("sampling-top-p-on-tensorrt", spec(**{**TRT, "sampling": {"temperature": 0, "topP": 1}})),
]


def _create(api: client.ApiClient, namespace: str, doc: Doc) -> Any:
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        "ember.dev",
        "v1alpha1",
        namespace,
        "inferencedeployments",
        doc,
        dry_run="All",
        field_validation="Strict",
    )


@pytest.mark.parametrize(("case", "change", "message"), REJECT, ids=[r[0] for r in REJECT])
def test_rejected(crd: Any, namespace: str, case: str, change: Change, message: str) -> None:
    doc = change(manifest(f"bad-{case}"[:56]))
    with pytest.raises(ApiException) as info:
        _create(crd.api, namespace, doc)
    assert info.value.status in (400, 422), info.value.body
    text = json.loads(info.value.body or "{}")["message"]
    assert message in text, text


@pytest.mark.parametrize(("case", "change"), ACCEPT, ids=[a[0] for a in ACCEPT])
def test_accepted(crd: Any, namespace: str, case: str, change: Change) -> None:
    created = _create(crd.api, namespace, change(manifest(f"ok-{case}")))
    spec_out = created["spec"]
    # Server-side defaulting from the schema (nested objects default to {} and then fill in).
    assert spec_out["engine"]["maxBatchSize"] >= spec_out["engine"]["minBatchSize"]
    assert spec_out["thermal"]["criticalCelsius"] > spec_out["thermal"]["throttleCelsius"]
    assert spec_out["server"]["port"] >= 1024


def test_update_is_validated_too(crd: Any, namespace: str) -> None:
    api = client.CustomObjectsApi(crd.api)
    api.create_namespaced_custom_object(
        "ember.dev", "v1alpha1", namespace, "inferencedeployments", manifest("upd")
    )
    with pytest.raises(ApiException) as info:
        api.patch_namespaced_custom_object(
            "ember.dev",
            "v1alpha1",
            namespace,
            "inferencedeployments",
            "upd",
            {"spec": {"thermal": {"criticalCelsius": 60}}},
        )
    assert "criticalCelsius must be greater than" in json.loads(info.value.body or "{}")["message"]
