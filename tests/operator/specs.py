"""Spec builders shared by the operator's unit and integration tests."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ember_operator import render, sizing, status
from ember_operator.api.models import InferenceDeploymentSpec
from ember_operator.settings import OperatorSettings
from ember_runtime.memory import GGUFShape

from tests.support.model import MODEL_FILENAME, MODEL_SHA256

SHA = "0123456789abcdef" * 4
# The kwok fleet's taint (tests/cluster/fleet.py): only pods that tolerate it land there.
SIM_TOLERATION = {
    "key": "ember.dev/simulated",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


def manifest(name: str = "demo", **spec_overrides: Any) -> dict[str, Any]:
    """A valid InferenceDeployment; overrides replace top-level spec keys."""
    spec: dict[str, Any] = {
        "model": {
            "name": "gemma-3-270m",
            "source": {"hostPath": {"path": "/var/lib/ember/models"}},
            "files": [{"path": "gemma.gguf", "sha256": SHA, "sizeBytes": 10 * 2**20}],
        },
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def hostpath_model(directory: Path, size: int) -> dict[str, Any]:
    """`spec.model` for the real Gemma file (its published sha256) in a node directory."""
    return {
        "name": "gemma-3-270m",
        "format": "gguf",
        "source": {"hostPath": {"path": str(directory)}},
        "files": [{"path": MODEL_FILENAME, "sha256": MODEL_SHA256, "sizeBytes": size}],
    }


def fleet_manifest(name: str, sites: list[str], replicas: int = 1) -> dict[str, Any]:
    """Runs on the kwok fleet: small explicit resources, pinned to sites, tolerating the taint."""
    return manifest(
        name,
        replicas=replicas,
        placement={"sites": sites, "tolerations": [SIM_TOLERATION]},
        resources={
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "256Mi"},
        },
    )


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Copy of doc with the dotted path set (list indices as numbers); value None deletes."""
    out = copy.deepcopy(doc)
    parts = dotted.split(".")
    node: Any = out
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if value is None:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


def size_of(
    spec: InferenceDeploymentSpec, settings: OperatorSettings, shape: GGUFShape | None = None
) -> sizing.Sizing:
    """What `reconcile.planned` computes: the runtime config, then the sizing read from it."""
    return sizing.compute(spec, render.runtime_config(spec, settings), settings, shape)


def rendered(
    owner: render.Owner,
    spec: InferenceDeploymentSpec,
    settings: OperatorSettings,
    shape: GGUFShape | None = None,
) -> list[dict[str, Any]]:
    """`reconcile.planned`'s manifests, without a cluster."""
    config = render.runtime_config(spec, settings)
    sized = sizing.compute(spec, config, settings, shape)
    return render.render(owner, spec, config, settings, sized)


def deployment(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    """A Deployment as the status code sees it (generation 2, observed), with these counts."""
    return {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        },
    }


def wire_status(obs: status.Observed, old: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status the writer diffs and patches: `build_status` in its wire form."""
    return status.to_wire(status.build_status(obs, old, now))
