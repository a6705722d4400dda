"""The pure renderer: typed spec → manifests, checked field by field without a cluster."""

from __future__ import annotations

from typing import Any

import yaml
from ember_operator import render
from ember_operator.api.models import parse_spec
from ember_operator.settings import OperatorSettings
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.wire import dump_yaml

from tests.operator.specs import manifest, rendered, size_of

OWNER = render.Owner(name="demo", namespace="ns", uid="u-1")
SETTINGS = OperatorSettings(runtime_image="example/runtime:1")


def _render(settings: OperatorSettings = SETTINGS, **overrides: Any) -> dict[str, dict[str, Any]]:
    spec = parse_spec(manifest(**overrides)["spec"])
    return {m["kind"]: m for m in rendered(OWNER, spec, settings)}


def _hash_of(out: dict[str, dict[str, Any]]) -> str:
    annotations = out["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    return str(annotations[render.CONFIG_HASH_ANNOTATION])


def _pod(out: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = out["Deployment"]["spec"]["template"]["spec"]
    return pod


def test_children_and_owner_references() -> None:
    out = _render()
    assert sorted(out) == ["ConfigMap", "Deployment", "Service"]  # no PDB for one replica
    for child in out.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "ember.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "name": "demo",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ember-operator"


def test_pdb_only_with_more_than_one_replica() -> None:
    out = _render(replicas=3)
    assert out["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    assert out["Deployment"]["spec"]["replicas"] == 3


def test_rollout_replaces_without_surging() -> None:
    # A full edge node (its CPUs, its one accelerator) has no room for a surge pod: the
    # default 25%/25% (maxSurge 1 for one replica) would leave the rollout Pending forever.
    for replicas in (1, 3):
        strategy = _render(replicas=replicas)["Deployment"]["spec"]["strategy"]
        assert strategy == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }


def test_pod_template_security_and_containers() -> None:
    pod = _pod(_render())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (init,) = pod["initContainers"]
    (runtime,) = pod["containers"]
    assert init["command"] == ["python", "-m", "ember_runtime.prewarm", "prewarm"]
    assert runtime["command"] == ["python", "-m", "ember_runtime.server"]
    for container in (init, runtime):
        sec = container["securityContext"]
        assert sec["readOnlyRootFilesystem"] is True
        assert sec["allowPrivilegeEscalation"] is False
        assert sec["capabilities"] == {"drop": ["ALL"]}
        assert container["image"] == "example/runtime:1"
    assert runtime["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert runtime["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert runtime["startupProbe"]["failureThreshold"] >= 3


def test_memory_volume_sized_from_shared_memory_limit() -> None:
    pod = _pod(_render(prewarm={"sharedMemoryLimit": "1Gi"}))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["prewarm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["model"]["hostPath"] == {"path": "/var/lib/ember/models", "type": "Directory"}
    runtime = pod["containers"][0]
    # tmpfs pages count against the pod: the limit must hold the volume plus inference memory.
    limit = runtime["resources"]["limits"]["memory"]
    from ember_operator import quantity

    assert quantity.parse(limit) > quantity.parse("1Gi") + 512 * 2**20


def test_no_prewarm_no_init_container_or_memory_volume() -> None:
    pod = _pod(_render(prewarm={"enabled": False}))
    assert "initContainers" not in pod
    assert "prewarm" not in {v["name"] for v in pod["volumes"]}


def test_sources_become_the_model_volume() -> None:
    pvc = _pod(
        _render(
            model={
                **manifest()["spec"]["model"],
                "source": {"pvc": {"claimName": "m", "subPath": "g"}},
            }
        )
    )
    vol = {v["name"]: v for v in pvc["volumes"]}["model"]
    assert vol["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}
    mount = {m["name"]: m for m in pvc["containers"][0]["volumeMounts"]}["model"]
    assert mount["subPath"] == "g"
    image = _pod(
        _render(model={**manifest()["spec"]["model"], "source": {"image": {"reference": "r/m:1"}}})
    )
    vol = {v["name"]: v for v in image["volumes"]}["model"]
    assert vol["image"] == {"reference": "r/m:1", "pullPolicy": "IfNotPresent"}


def test_accelerators_request_their_extended_resource() -> None:
    npu_pod = _pod(_render(accelerator={"kind": "npu", "count": 2}))
    npu = npu_pod["containers"][0]["resources"]
    assert npu["limits"]["ember.dev/npu"] == "2" and npu["requests"]["ember.dev/npu"] == "2"
    # Preflight inspects the same devices (the kubelet passes them on to the app container).
    init = npu_pod["initContainers"][0]["resources"]
    assert init["limits"]["ember.dev/npu"] == "2" and init["requests"]["ember.dev/npu"] == "2"
    gpu = _pod(_render(accelerator={"kind": "nvidia-gpu", "count": 1}))
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu_pod = _pod(_render())
    cpu = cpu_pod["containers"][0]["resources"]
    assert set(cpu["limits"]) == {"cpu", "memory"}
    assert set(cpu_pod["initContainers"][0]["resources"]["limits"]) == {"cpu", "memory"}
    assert cpu["limits"] == cpu["requests"]  # Guaranteed QoS


def test_gpu_replicas_get_the_gpu_image() -> None:
    gpu_settings = OperatorSettings(runtime_image="ex/cpu:1", runtime_gpu_image="ex/cuda:1")
    gpu = {"accelerator": {"kind": "nvidia-gpu"}}

    def images(settings: OperatorSettings, **overrides: Any) -> set[str]:
        pod = _pod(_render(settings, **overrides))
        return {c["image"] for c in pod["containers"] + pod["initContainers"]}

    assert images(gpu_settings, **gpu) == {"ex/cuda:1"}
    assert images(gpu_settings) == {"ex/cpu:1"}  # CPU replicas keep the CPU image
    assert images(gpu_settings, accelerator={"kind": "npu"}) == {"ex/cpu:1"}
    assert images(gpu_settings, image="ex/mine:2", **gpu) == {"ex/mine:2"}  # the spec wins
    assert images(SETTINGS, **gpu) == {"example/runtime:1"}  # no GPU image: the CPU one


def test_sites_pin_and_spread() -> None:
    pod = _pod(_render(placement={"sites": ["a", "b"], "nodeSelector": {"disk": "ssd"}}))
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a", "b"]
    assert pod["nodeSelector"] == {"disk": "ssd"}
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert spread["ember.dev/site"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "ScheduleAnyway"
    loose = _pod(_render())
    assert {c["whenUnsatisfiable"] for c in loose["topologySpreadConstraints"]} == {
        "ScheduleAnyway"
    }


def test_configmap_holds_runtime_config_and_sizing() -> None:
    out = _render(engine={"contextLength": 4096, "maxBatchSize": 8, "minBatchSize": 2})
    data = out["ConfigMap"]["data"]
    config = RuntimeConfig.model_validate(yaml.safe_load(data["config.yaml"]))
    assert config.model_name == "gemma-3-270m"
    assert config.engine.context_length == 4096 and config.engine.max_batch_size == 8
    assert config.prewarm_dir == SETTINGS.prewarm_mount
    assert config.total_bytes() == 10 * 2**20
    figures = yaml.safe_load(data["sizing.yaml"])
    assert figures["source"] == "estimate" and figures["threads"] == 1
    assert not config.engine.deterministic  # fast batching unless asked


def test_deterministic_reaches_the_runtime_config() -> None:
    out = _render(engine={"deterministic": True})
    config = RuntimeConfig.model_validate(yaml.safe_load(out["ConfigMap"]["data"]["config.yaml"]))
    assert config.engine.deterministic
    assert config.engine.llamacpp_modes().deterministic


def test_an_embedding_model_reaches_the_runtime_config() -> None:
    def config_of(model: dict[str, Any]) -> RuntimeConfig:
        data = _render(model=model)["ConfigMap"]["data"]["config.yaml"]
        return RuntimeConfig.model_validate(yaml.safe_load(data))

    model = manifest()["spec"]["model"]
    chosen = config_of({**model, "task": "embed", "pooling": "last"})
    assert (chosen.task, chosen.pooling) == ("embed", "last")
    from_gguf = config_of({**model, "task": "embed"})
    assert (from_gguf.task, from_gguf.pooling) == ("embed", None)
    default = config_of(model)
    assert (default.task, default.pooling) == ("generate", None)


def test_the_task_rolls_the_replicas_and_its_default_rolls_none() -> None:
    model = manifest()["spec"]["model"]
    plain = _render()
    assert _hash_of(_render(model={**model, "task": "generate"})) == _hash_of(plain)
    assert (
        "task"
        not in RuntimeConfig.model_validate(
            yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"])
        ).restart_relevant_yaml()
    )
    embed = _render(model={**model, "task": "embed"})
    assert _hash_of(embed) != _hash_of(plain)
    assert _hash_of(_render(model={**model, "task": "embed", "pooling": "cls"})) != _hash_of(embed)


def test_sampling_defaults_reach_the_runtime_config_and_unset_roll_nothing() -> None:
    like_llama = {"temperature": 0.8, "topP": 0.95, "topK": 40, "minP": 0.05}
    out = _render(sampling=like_llama)
    config = RuntimeConfig.model_validate(yaml.safe_load(out["ConfigMap"]["data"]["config.yaml"]))
    assert config.sampling.given() == {
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
    }
    plain = _render()
    assert _hash_of(out) != _hash_of(plain)  # the runtime reads them at start
    # An operator upgrade that adds the field leaves existing replicas' hash as it was.
    unset = RuntimeConfig.model_validate(yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"]))
    assert "sampling" not in unset.restart_relevant_yaml()
    assert _hash_of(_render(sampling={})) == _hash_of(plain)


def test_gpu_layers_reach_the_runtime_config_and_sizing() -> None:
    out = _render(accelerator={"kind": "nvidia-gpu"}, engine={"gpuLayers": 20})
    data = out["ConfigMap"]["data"]
    config = RuntimeConfig.model_validate(yaml.safe_load(data["config.yaml"]))
    assert config.engine.gpu_layers == 20
    assert config.engine.offloaded_layers(config.accelerator) == 20
    figures = yaml.safe_load(data["sizing.yaml"])
    assert figures["gpu_layers"] == 20 and figures["deviceMemory"].endswith("Mi")
    unset = _render(accelerator={"kind": "nvidia-gpu"})["ConfigMap"]["data"]["config.yaml"]
    assert RuntimeConfig.model_validate(yaml.safe_load(unset)).engine.gpu_layers is None


def test_config_hash_changes_with_the_spec_only() -> None:
    assert _hash_of(_render()) == _hash_of(_render())
    assert _hash_of(_render()) != _hash_of(_render(engine={"contextLength": 4096}))


def test_a_thermal_policy_change_reaches_the_configmap_but_restarts_nothing() -> None:
    """The runtime reloads its `thermal:` section from the mounted file; the pod template (and
    so every replica) stays as it is."""
    hot = {"throttleCelsius": 70, "criticalCelsius": 85, "celsiusPerStep": 3}
    before, after = _render(), _render(thermal=hot)
    assert before["Deployment"] == after["Deployment"]
    config = RuntimeConfig.model_validate(yaml.safe_load(after["ConfigMap"]["data"]["config.yaml"]))
    assert (config.thermal.throttle_celsius, config.thermal.celsius_per_step) == (70.0, 3.0)
    assert before["ConfigMap"] != after["ConfigMap"]
    assert config.sensors.report_condition is True


def test_static_renders_as_off_did_no_thermal_batch_control() -> None:
    """`policy: static` (plain YAML) is the old `"off"` under a name YAML reads as written: the
    same rendered objects, the runtime's policy not adaptive; `adaptive` differs in that alone."""
    static = _render(**yaml.safe_load("thermal: {policy: static}"))
    assert static == _render(thermal={"policy": "off"})
    config = RuntimeConfig.model_validate(
        yaml.safe_load(static["ConfigMap"]["data"]["config.yaml"])
    )
    assert config.thermal.adaptive is False
    assert config.limits().next_batch(120.0, None) == config.engine.max_batch_size
    adaptive = _render(thermal={"policy": "adaptive"})
    assert adaptive["Deployment"] == static["Deployment"]  # a policy change restarts nothing
    on = RuntimeConfig.model_validate(yaml.safe_load(adaptive["ConfigMap"]["data"]["config.yaml"]))
    assert on.thermal.adaptive is True and on.thermal.model_copy(update={"adaptive": False}) == (
        config.thermal
    )


def test_runtime_identity_and_token_only_in_the_runtime() -> None:
    pod = _pod(_render())
    assert pod["serviceAccountName"] == SETTINGS.runtime_service_account
    assert pod["automountServiceAccountToken"] is False
    runtime = next(c for c in pod["containers"] if c["name"] == "runtime")
    assert render.SA_MOUNT in {m["mountPath"] for m in runtime["volumeMounts"]}
    for init in pod.get("initContainers", []):
        assert render.SA_MOUNT not in {m["mountPath"] for m in init["volumeMounts"]}
    sa, binding = render.runtime_identity("ns", SETTINGS)
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "ember-runtime"
    assert binding["roleRef"]["name"] == SETTINGS.runtime_cluster_role
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ember-runtime", "namespace": "ns"}
    ]


def test_user_strings_cannot_change_the_document() -> None:
    evil = 'x"\n  injected: true\nkind: Secret", "injected": true}, "kind": "Secret'
    out = _render(
        model={**manifest()["spec"]["model"], "name": evil}, placement={"nodeSelector": {"k": evil}}
    )
    assert out["Deployment"]["kind"] == "Deployment"
    assert _pod(out)["nodeSelector"] == {"k": evil}
    assert "injected" not in out["Deployment"]


def test_libyaml_dumps_what_the_python_dumper_does() -> None:
    """The ConfigMap's documents and the pod template's hash come from `dump_yaml` (libyaml):
    a byte of difference from PyYAML's own SafeDumper would re-apply every child and roll
    every replica the first time an upgraded operator reconciles."""
    spec = parse_spec(manifest(model={**manifest()["spec"]["model"], "name": "é ✓ 'x'"})["spec"])
    sized = size_of(spec, SETTINGS)
    config = render.runtime_config(spec, SETTINGS).model_dump(mode="json", by_alias=True)
    odd = {"long": "y" * 300, "lines": "a\nb", "empty": "", "none": None, "words": ["yes", "1e3"]}
    for data, sort_keys in ((config, False), (sized.as_dict(), True), (odd, False)):
        assert dump_yaml(data, sort_keys=sort_keys) == yaml.safe_dump(data, sort_keys=sort_keys)


def test_schema_valid_but_unservable_specs_are_problems() -> None:
    spec = parse_spec(manifest(prewarm={"sharedMemoryLimit": "1Mi"})["spec"])
    sized = size_of(spec, SETTINGS)
    assert [p.reason for p in render.problems(spec, sized)] == ["SharedMemoryTooSmall"]
    ok = parse_spec(manifest()["spec"])
    assert render.problems(ok, size_of(ok, SETTINGS)) == []


def _sensors_root(out: dict[str, dict[str, Any]]) -> str:
    config = RuntimeConfig.model_validate(yaml.safe_load(out["ConfigMap"]["data"]["config.yaml"]))
    return config.sensors.sysfs_root


def test_host_sysfs_needs_no_volume() -> None:
    out = _render()
    pod = _pod(out)
    assert _sensors_root(out) == "/sys"
    assert "sensors" not in {v["name"] for v in pod["volumes"]}
    assert "sensors" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}


def test_fake_sysfs_root_is_mounted_read_only() -> None:
    fake = OperatorSettings(runtime_image="example/runtime:1", sensors_sysfs_root="/var/fake-sys")
    out = _render(fake)
    pod = _pod(out)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "sensors"]
    assert volume["hostPath"] == {"path": "/var/fake-sys", "type": "Directory"}
    runtime, *_ = pod["containers"]
    (mount,) = [m for m in runtime["volumeMounts"] if m["name"] == "sensors"]
    assert mount == {"name": "sensors", "mountPath": "/host-sys", "readOnly": True}
    assert _sensors_root(out) == "/host-sys"
    assert all(m["name"] != "sensors" for m in pod["initContainers"][0]["volumeMounts"])


HTTP_SOURCE = {"http": {"urls": {"gemma.gguf": "https://models.example/g.gguf?sig=1"}}}


def _http_model(**source: Any) -> dict[str, Any]:
    model: dict[str, Any] = manifest()["spec"]["model"]
    return {**model, "source": {"http": {**HTTP_SOURCE["http"], **source}}}


def test_http_source_mounts_only_its_own_digests_and_tells_the_agent_what_to_fetch() -> None:
    """Hole 7 (issue 34): a replica sees a view per digest of its own files, never the node
    cache (every namespace's models), and the runtime container sees none of them."""
    out = _render(model=_http_model(secretRef={"name": "hf"}))
    pod = _pod(out)
    sha = manifest()["spec"]["model"]["files"][0]["sha256"]
    host_paths = [v["hostPath"] for v in pod["volumes"] if "hostPath" in v]
    # Its digest's view, and its own adapters view (hard links to its adapters only).
    assert host_paths == [
        {"path": f"/var/lib/ember/cache/views/{sha}", "type": "Directory"},
        {"path": "/var/lib/ember/cache/adapters/ns/demo", "type": "Directory"},
    ]
    prewarm = pod["initContainers"][0]
    view = {"name": "model-0", "mountPath": f"/models/{sha}", "readOnly": True}
    assert view in prewarm["volumeMounts"]
    runtime_mounts = {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert not {"model", "model-0"} & runtime_mounts, runtime_mounts
    template = out["Deployment"]["spec"]["template"]["metadata"]
    # What to fetch is never on the pod (a pod author could write it there: issue 34, hole 1):
    # the pod names its InferenceDeployment, and a digest of the fetch list rolls the pods when
    # a URL changes.
    assert "ember.dev/model-fetch" not in template["annotations"]
    assert template["labels"]["ember.dev/instance"] == "demo"
    digest = template["annotations"]["ember.dev/model-fetch-hash"]
    other = _render(model=_http_model(urls={"gemma.gguf": "https://models.example/other"}))
    other_template = other["Deployment"]["spec"]["template"]["metadata"]
    assert other_template["annotations"]["ember.dev/model-fetch-hash"] != digest
    file = manifest()["spec"]["model"]["files"][0]
    config = RuntimeConfig.model_validate(yaml.safe_load(out["ConfigMap"]["data"]["config.yaml"]))
    assert config.model_layout == "sha256"
    assert str(config.source_file(config.files[0])) == f"/models/{file['sha256']}/data"


def test_hostpath_source_has_no_fetch_annotation_and_keeps_its_hash() -> None:
    """Existing objects must not roll when the operator learns the http source."""
    out = _render()
    annotations = out["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert list(annotations) == ["ember.dev/config-hash"]
    config_yaml = out["ConfigMap"]["data"]["config.yaml"]
    assert (
        "modelLayout"
        not in RuntimeConfig.model_validate(yaml.safe_load(config_yaml)).restart_relevant_yaml()
    )


def test_http_source_prefers_nodes_that_hold_the_model() -> None:
    """A preferred (never required) term per file for the agent's cache label, beside the
    required sites; a hostPath source has none, so existing objects do not roll."""
    two = [
        {"path": "a.gguf", "sha256": "ab" * 32, "sizeBytes": 10},
        {"path": "b.gguf", "sha256": "cd" * 32, "sizeBytes": 20},
    ]
    urls = {"a.gguf": "https://m.example/a", "b.gguf": "https://m.example/b"}
    model = {**manifest()["spec"]["model"], "files": two, "source": {"http": {"urls": urls}}}
    pod = _pod(_render(model=model, placement={"sites": ["s1"]}))
    node_affinity = pod["affinity"]["nodeAffinity"]
    required = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["s1"]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "weight": 50,
            "preference": {
                "matchExpressions": [
                    {"key": f"cache.ember.dev/{sha[:16]}", "operator": "In", "values": ["true"]}
                ]
            },
        }
        for sha in ("ab" * 32, "cd" * 32)
    ]
    one = _pod(_render(model=_http_model()))["affinity"]["nodeAffinity"]
    assert list(one) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    assert one["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 100
    assert "affinity" not in _pod(_render())


def test_prewarm_asks_for_the_cpu_the_user_asked_for_the_runtime() -> None:
    """The scheduler counts the larger of the init and app containers' requests: a sized CPU
    on prewarm would make a quarter-core replica count a whole core (four such models would not
    fit a 2-CPU node). Sized when the spec sets no resources."""
    small = _pod(_render(resources={"requests": {"cpu": "250m"}}))
    assert small["initContainers"][0]["resources"]["requests"]["cpu"] == "250m"
    assert small["containers"][0]["resources"]["requests"]["cpu"] == "250m"
    sized = _pod(_render())
    prewarm, runtime = sized["initContainers"][0], sized["containers"][0]
    assert prewarm["resources"]["requests"]["cpu"] == runtime["resources"]["requests"]["cpu"]
