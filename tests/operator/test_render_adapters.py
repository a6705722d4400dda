"""spec.adapters rendered (issue 47): into the runtime config's `engine.adapters`, never into
the pod template's hash, so adding or removing an adapter rewrites the ConfigMap (which running
runtimes reload) and restarts no pod. An http source's adapters come through the node agent's
per-object adapters view, mounted read-only into the runtime container only."""

from __future__ import annotations

from typing import Any

import yaml
from ember_operator import render
from ember_operator.api.models import parse_spec
from ember_runtime.contract.config import RuntimeConfig

from tests.operator.specs import manifest, rendered
from tests.operator.test_render import OWNER, SETTINGS, _hash_of, _http_model, _pod

A = {"name": "style-a", "path": "loras/a.gguf", "sha256": "a" * 64, "sizeBytes": 1000}
B = {"name": "style-b", "path": "loras/b.gguf", "sha256": "b" * 64, "sizeBytes": 2000, "scale": 0.5}


def _render(**overrides: Any) -> dict[str, dict[str, Any]]:
    spec = parse_spec(manifest(**overrides)["spec"])
    return {m["kind"]: m for m in rendered(OWNER, spec, SETTINGS)}


def _config(out: dict[str, dict[str, Any]]) -> RuntimeConfig:
    return RuntimeConfig.model_validate(yaml.safe_load(out["ConfigMap"]["data"]["config.yaml"]))


def _with_url(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "url": f"https://models.example/{entry['name']}.gguf"}


def test_adapters_reach_the_config_relative_to_the_model_dir() -> None:
    config = _config(_render(adapters=[A, B]))
    assert [(a.name, a.path, a.sha256, a.scale) for a in config.engine.adapters] == [
        ("style-a", "loras/a.gguf", "a" * 64, 1.0),
        ("style-b", "loras/b.gguf", "b" * 64, 0.5),
    ]
    adapter = config.engine.adapters[0]
    assert str(config.adapter_file(adapter)) == f"{SETTINGS.model_mount}/loras/a.gguf"


def test_adding_or_removing_an_adapter_restarts_no_pod() -> None:
    none, one, two = _render(), _render(adapters=[A]), _render(adapters=[A, B])
    assert _hash_of(none) == _hash_of(one) == _hash_of(two)
    assert none["Deployment"] == one["Deployment"] == two["Deployment"]
    assert none["ConfigMap"] != one["ConfigMap"] != two["ConfigMap"]
    # The hash still follows what does restart the runtime.
    assert _hash_of(_render(adapters=[A], engine={"contextLength": 4096})) != _hash_of(one)


def test_an_http_source_reads_its_adapters_from_its_own_view() -> None:
    model = _http_model()
    out = _render(model=model, adapters=[_with_url(A), _with_url(B)])
    config = _config(out)
    assert [a.path for a in config.engine.adapters] == [
        f"{render.ADAPTERS_MOUNT}/{'a' * 64}",
        f"{render.ADAPTERS_MOUNT}/{'b' * 64}",
    ]
    assert str(config.adapter_file(config.engine.adapters[0])) == f"/adapters/{'a' * 64}"
    pod = _pod(out)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "adapters"]
    # This object's own view (namespace and name), never the cache or another object's.
    assert volume["hostPath"] == {
        "path": "/var/lib/ember/cache/adapters/ns/demo",
        "type": "Directory",
    }
    runtime = pod["containers"][0]["volumeMounts"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in runtime
    assert all(m["name"] != "adapters" for m in pod["initContainers"][0]["volumeMounts"])
    # A second adapter is one more link in the same view: same pod template.
    one = _render(model=model, adapters=[_with_url(A)])
    assert one["Deployment"] == out["Deployment"]
    # Nor does the first adapter, or the last one removed: the view is mounted either way, and
    # adapter URLs do not change what the agent is told to fetch for the model.
    bare = _render(model=model)
    assert bare["Deployment"] == one["Deployment"]


def test_no_adapters_view_without_an_http_source() -> None:
    out = _render(adapters=[A])
    assert all(v["name"] != "adapters" for v in _pod(out)["volumes"])
