"""Hole 7 (issue 34), cache half, on the real kubelet node: a replica of tenant B sees nothing
of tenant A's model that sits in the node cache.

Tenant A's private model is in the cache (as the agent leaves it after A's replica ran here).
Tenant B's replica pod is rendered by the operator's own `render()` for B's http source, and
run on the real node next to the real node agent (a process with the chart's RBAC); its
prewarm container, B's own image in real life, here lists every file on every volume it has and
hashes each file of A's size. Before the fix it found A's blob under /models/sha256/; now it
has one view, of B's digest, and nothing of A's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from typing import Any

import pytest
from ember_operator import render
from ember_operator.api.models import parse_spec
from ember_operator.settings import OperatorSettings

from tests.cluster.control_plane import NODE_NAME
from tests.cluster.images import BASE_IMAGE
from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.operator import rest
from tests.operator.specs import manifest, rendered
from tests.operator.test_http_source_node import CACHE, agent  # noqa: F401 - fixture
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.node, pytest.mark.timeout(600)]

A_DATA = os.urandom(40_000)
A_SHA = hashlib.sha256(A_DATA).hexdigest()
B_DATA = os.urandom(30_000)
B_SHA = hashlib.sha256(B_DATA).hexdigest()

# Every file on every volume of the container (not /proc, /sys, /dev, nor the image itself),
# and the sha256 of each file as large as A's.
LOOK = f"""
for m in $(awk '{{print $5}}' /proc/self/mountinfo | sort -u); do
  case "$m" in /|/proc*|/sys*|/dev*) continue;; esac
  echo "mount $m"
  find "$m" -xdev 2>/dev/null | while read -r f; do
    echo "file $f"
    if [ -f "$f" ] && [ "$(stat -c %s "$f" 2>/dev/null)" = "{len(A_DATA)}" ]; then
      echo "hash $(sha256sum "$f" 2>/dev/null)"
    fi
  done
done
echo done
"""


def _tenant_b(url: str) -> dict[str, Any]:
    """B's InferenceDeployment: the node agent reads what to fetch from its spec."""
    model = {
        "name": "b-model",
        "format": "gguf",
        "source": {"http": {"urls": {"b.gguf": url}}},
        "files": [{"path": "b.gguf", "sha256": B_SHA, "sizeBytes": len(B_DATA)}],
    }
    return manifest("b", model=model, prewarm={"enabled": True})


def _tenant_b_pod(namespace: str, url: str) -> dict[str, Any]:
    """B's replica as the operator renders it, its prewarm container running LOOK instead."""
    spec = parse_spec(_tenant_b(url)["spec"])
    settings = OperatorSettings()
    owner = render.Owner("b", namespace, "u-b")
    out = {m["kind"]: m for m in rendered(owner, spec, settings)}
    template = out["Deployment"]["spec"]["template"]
    pod_spec = template["spec"]
    prewarm = pod_spec["initContainers"][0]
    look = {
        **prewarm,
        "name": "look",
        "image": BASE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", LOOK],
        "args": [],
        "resources": {},
    }
    look.pop("env", None)
    # Every volume of the replica's model; its config map is not needed to look around.
    look["volumeMounts"] = [m for m in prewarm["volumeMounts"] if m["name"] != "config"]
    mounted = {m["name"] for m in look["volumeMounts"]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "b-look",
            "namespace": namespace,
            # Which InferenceDeployment it belongs to, and its fetch digest (issue 34, hole 1).
            "labels": template["metadata"]["labels"],
            "annotations": template["metadata"]["annotations"],
        },
        "spec": {
            "nodeName": NODE_NAME,
            "restartPolicy": "Never",
            "securityContext": pod_spec.get("securityContext", {}),
            "automountServiceAccountToken": False,
            "containers": [look],
            "volumes": [v for v in pod_spec["volumes"] if v["name"] in mounted],
        },
    }


def test_tenant_b_replica_sees_nothing_of_tenant_as_cached_model(
    kube: Kube,
    namespace: str,
    crd: Any,
    agent: subprocess.Popen[str],  # noqa: F811 - the fixture
) -> None:
    blob = CACHE / "sha256" / A_SHA
    blob.write_bytes(A_DATA)  # tenant A's private model, as the agent caches it
    blob.chmod(0o644)
    try:
        with serve({"b.gguf": B_DATA}) as (base, _):
            rest.create(kube.api, "infd", namespace, _tenant_b(f"{base}/b.gguf"))
            pod = _tenant_b_pod(namespace, f"{base}/b.gguf")
            rest.create(kube.api, "pods", namespace, pod)

            def finished() -> str | None:
                got = rest.get(kube.api, "pods", namespace, "b-look") or {}
                phase = (got.get("status") or {}).get("phase")
                return phase if phase in ("Succeeded", "Failed") else None

            try:
                phase = wait_for("tenant B's pod to finish", finished, timeout=300, interval=1)
            finally:
                events = kube.kubectl("get", "events", "-n", namespace)
            seen = kube.kubectl("logs", "-n", namespace, "b-look")
        assert phase == "Succeeded", f"{phase}\n{seen}\n{events}"
        assert seen.rstrip().endswith("done"), seen
        assert A_SHA not in seen, seen  # no name of A's, and no file with A's bytes
        assert "/models/sha256" not in seen, seen  # nor the cache's directory of blobs
        assert f"mount /models/{B_SHA}" in seen, seen  # B's own view is there
        print(json.dumps(seen.splitlines()[:40], indent=1))
    finally:
        blob.unlink(missing_ok=True)
        shutil.rmtree(CACHE / "views" / B_SHA, ignore_errors=True)  # the stopped agent's view
        for p in (CACHE / "sha256" / B_SHA, CACHE / "sha256" / f"{B_SHA}.partial"):
            p.unlink(missing_ok=True)
