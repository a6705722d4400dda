"""The plugin against the REAL kubelet of the local single-node cluster (tests/cluster/); the
plugin process and its fake NPUs come from tests/deviceplugin/realnode.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.deviceplugin.podresources import PodResourcesClient
from kubernetes import client

from tests.support.waiting import wait_for

from .realnode import CONTEXTS, DEVICES, RESOURCE, live_contexts, plugin

__all__ = ["plugin"]  # the plugin process fixture, requested by name below

pytestmark = pytest.mark.node


def test_real_kubelet_allocates_and_releases_contexts(
    node: Any, kube: Any, namespace: str, plugin: dict[str, Path]
) -> None:
    core = client.CoreV1Api(kube.api)

    def capacity() -> bool:
        status = core.read_node(node.name).status
        cap = (status.capacity if status else None) or {}
        return cap.get(RESOURCE) == str(DEVICES * CONTEXTS)

    wait_for(f"{RESOURCE} capacity on {node.name}", capacity, 90)

    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "npu-env", "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": node.base_image,
                    "imagePullPolicy": "Never",
                    "command": [
                        "/bin/sh",
                        "-c",
                        "env; ls -l /dev/davinci*; echo LISTED; sleep 3600",
                    ],
                    "resources": {"limits": {RESOURCE: "1"}},
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type] # dicts serialize as-is

    def logs() -> str | None:
        status = core.read_namespaced_pod("npu-env", namespace).status
        phase = status.phase if status else None
        assert phase in {"Pending", "Running"}, phase
        if phase != "Running":
            return None
        text: str = core.read_namespaced_pod_log("npu-env", namespace)
        # Read once the listing is complete: a read between `env` and `ls` (seen in CI) has
        # the environment but not yet the device nodes.
        return text if "\nLISTED\n" in text else None

    text = wait_for("the pod's env in its log", logs, 120)
    ctx = re.search(r"^ACL_CONTEXT_ID=(\d+)$", text, re.M)
    dev = re.search(r"^ASCEND_DEVICE_ID=(\d+)$", text, re.M)
    assert ctx and dev, text
    assert re.search(rf"^EMBER_NPU_CONTEXT={dev.group(1)}:{ctx.group(1)}$", text, re.M), text
    assert f"/dev/davinci{dev.group(1)}" in text  # the DeviceSpec reached the container
    context_id = int(ctx.group(1))

    # The plugin binds the ID to its container once the real PodResources API reports it.
    owner = f"{namespace}/npu-env/main"
    wait_for(
        "the context bound to its container via PodResources",
        lambda: live_contexts(plugin["checkpoint"]).get(context_id) == owner,
        30,
    )

    def kubelet_owners() -> dict[str, frozenset[str]]:
        return asyncio.run(PodResourcesClient(node.pod_resources_socket).owners(RESOURCE))

    assert len(kubelet_owners().get(owner, ())) == 1  # the kubelet's own view agrees

    core.delete_namespaced_pod("npu-env", namespace, grace_period_seconds=0)
    wait_for("PodResources to drop the pod", lambda: owner not in kubelet_owners(), 60)
    wait_for(
        "the context ID released after the pod is gone",
        lambda: context_id not in live_contexts(plugin["checkpoint"]),
        60,
    )
