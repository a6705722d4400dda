"""The committed CRD is what the models generate, and it is a structural schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from ember_operator.api import crdgen

CRDS = Path(__file__).resolve().parents[2] / "crds"


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_committed_crds_match_the_models() -> None:
    for name, text in crdgen.render_files().items():
        committed = (CRDS / name).read_text()
        assert committed == text, f"crds/{name} is stale: run `make crds`"


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0
    target = tmp_path / crdgen.CRD_FILE
    target.write_text(target.read_text().replace("maxBatchSize", "maxBatch"))
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1


def test_schema_is_structural() -> None:
    schema = crdgen.open_api_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node and "$defs" not in node, path
        assert "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
            assert all(m.get("type") != "null" for m in node["anyOf"]), path
        if "properties" in node:
            assert node.get("type") == "object", path


def test_every_cel_rule_has_a_message() -> None:
    rules = [
        rule
        for _, node in _walk(crdgen.open_api_schema())
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 10
    for rule in rules:
        assert rule["message"] and len(rule["message"]) > 20, rule


def test_defaults_enums_bounds_and_subresources() -> None:
    crd = yaml.safe_load((CRDS / crdgen.CRD_FILE).read_text().split("\n", 1)[1])
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    engine = spec["properties"]["engine"]
    # Spelled-out defaults: the API server checks a default against CEL before nested defaulting.
    assert engine["default"] == {
        "kind": "llamacpp",
        "contextLength": 2048,
        "maxBatchSize": 16,
        "minBatchSize": 4,
        "deterministic": False,
    }
    assert engine["properties"]["maxBatchSize"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 256,
        "default": 16,
        "description": engine["properties"]["maxBatchSize"]["description"],
    }
    assert engine["properties"]["kind"]["enum"] == ["llamacpp", "tensorrt-llm"]
    assert spec["properties"]["replicas"]["minimum"] == 0
    assert spec["required"] == ["model"]
    shm = spec["properties"]["prewarm"]["properties"]["sharedMemoryLimit"]
    assert shm["x-kubernetes-int-or-string"] is True
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["infd"] and names["categories"] == ["ember"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Ready",
        "Model",
        "Engine",
        "Accelerator",
        "Status",
        "Temp",
        "Batch",
        "J/Token",
        "Rollout",
        "Age",
    ]
    wide = {c["name"]: c for c in version["additionalPrinterColumns"]}["J/Token"]
    assert (wide["priority"], wide["jsonPath"]) == (1, ".status.joulesPerToken")  # -o wide
