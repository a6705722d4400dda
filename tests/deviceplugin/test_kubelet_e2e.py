"""The plugin against the REAL kubelet of the local single-node cluster (tests/cluster/).

The plugin runs as a host process (as its DaemonSet would, with hostPath mounts) pointed at the
kubelet's device plugin dir. The fake NPUs are symlinks to /dev/null: discovery and health only
need the paths, and the container runtime needs a real character device behind a DeviceSpec.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.deviceplugin.allocator import Checkpoint
from ember_runtime.deviceplugin.podresources import PodResourcesClient
from kubernetes import client

from .harness import short_tempdir

pytestmark = pytest.mark.node

RESOURCE = "ember.dev/npu"
DEVICES = 2
CONTEXTS = 4


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def plugin(node: Any) -> Iterator[dict[str, Path]]:
    work = short_tempdir()
    dev = work / "dev"
    dev.mkdir()
    for i in range(DEVICES):
        (dev / f"davinci{i}").symlink_to("/dev/null")
    (dev / "davinci_manager").symlink_to("/dev/null")
    checkpoint = work / "allocations.json"
    log = work / "plugin.log"
    argv = [
        sys.executable, "-m", "ember_runtime.deviceplugin",
        "--device-plugin-dir", str(node.device_plugin_dir),
        "--pod-resources-socket", str(node.pod_resources_socket),
        "--dev-root", str(dev),
        "--contexts-per-device", str(CONTEXTS),
        "--checkpoint-path", str(checkpoint),
        "--reconcile-interval-seconds", "1",
        "--release-grace-seconds", "30",
        "--metrics-port", "0",
        "--metrics-host", "127.0.0.1",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        yield {"checkpoint": checkpoint, "log": log}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        assert code == 0, log.read_text()
        assert not (node.device_plugin_dir / "ember-npu.sock").exists()


def live_contexts(checkpoint: Path) -> dict[int, str | None]:
    """Context ID -> owner ("ns/pod/container") as the plugin's checkpoint records it."""
    return {
        cid: alloc["owner"]
        for alloc in Checkpoint(checkpoint).read_live()
        for cid in alloc["contexts"].values()
    }


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
                    "command": ["/bin/sh", "-c", "env; ls -l /dev/davinci*; sleep 3600"],
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
        return text if "ACL_CONTEXT_ID=" in text else None

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
