"""The device plugin as a host process on the REAL kubelet node (tests/cluster/), shared by the
kubelet e2e test and the kubelet restart drill.

The plugin runs as its DaemonSet would (hostPath mounts), pointed at the kubelet's device
plugin dir. The fake NPUs are symlinks to /dev/null: discovery and health only need the paths,
and the container runtime needs a real character device behind a DeviceSpec.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.deviceplugin.allocator import Checkpoint

from tests.support.waiting import wait_for

if importlib.util.find_spec("ember_runtime.deviceplugin.api.api_pb2") is None:
    # The plugin process needs the gRPC stubs (`make protos`); callers outside
    # tests/deviceplugin (the drills) do not get them from that conftest.
    from ember_runtime.deviceplugin.api.generate import generate

    generate()

RESOURCE = "ember.dev/npu"
DEVICES = 2
CONTEXTS = 4
REGISTERED = f"registered {RESOURCE} with the kubelet"  # the plugin's log line on success


@pytest.fixture
def plugin(node: Any) -> Iterator[dict[str, Path]]:
    work = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # short: unix socket paths
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
        # The node's capacity may still show an earlier plugin's devices (a previous test's),
        # whose kubelet endpoint is gone: a pod admitted before this plugin registers fails.
        wait_for(
            "the plugin's registration with the kubelet",
            lambda: proc.poll() is None and REGISTERED in log.read_text(errors="replace"),
            60,
            0.1,
        )
        yield {"checkpoint": checkpoint, "log": log}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        assert code == 0, log.read_text()
        assert not (node.device_plugin_dir / "ember-npu.sock").exists()


def live_contexts(checkpoint: Path) -> dict[int, str | None]:
    """Context ID -> owner ("ns/pod/container") as the plugin's checkpoint records it."""
    return {
        cid: alloc.owner
        for alloc in Checkpoint(checkpoint).load().allocations
        for cid in alloc.contexts.values()
    }


def kubelet_npu_units(pod_resources_socket: Path) -> int:
    """The ember.dev/npu units the kubelet's own device manager holds now (PodResources
    GetAllocatableResources). Right after a restart the node object in the API server still
    shows the old allocatable while the kubelet has none until the plugin's ListAndWatch
    delivers them, and a pod admitted in between fails with UnexpectedAdmissionError."""
    from ember_runtime.deviceplugin.api import podresources_pb2 as pr

    request = pr.AllocatableResourcesRequest()
    resp = _pod_resources(pod_resources_socket, "GetAllocatableResources", request)
    if resp is None:
        return 0  # the kubelet is not serving yet
    return sum(len(d.device_ids) for d in resp.devices if d.resource_name == RESOURCE)


def kubelet_pods(pod_resources_socket: Path) -> set[str]:
    """The pods the kubelet lists through PodResources: once its API source has delivered them
    after a restart. Until then the device manager keeps the units of pods deleted meanwhile
    (it prunes only once its pod sources are ready), so a pod admitted that early can find
    every unit still "in use" and be refused with UnexpectedAdmissionError."""
    from ember_runtime.deviceplugin.api import podresources_pb2 as pr

    resp = _pod_resources(pod_resources_socket, "List", pr.ListPodResourcesRequest())
    return set() if resp is None else {p.name for p in resp.pod_resources}


def _pod_resources(socket: Path, method: str, request: Any) -> Any:
    import grpc
    from ember_runtime.deviceplugin.api import podresources_pb2_grpc as pr_grpc

    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            return getattr(stub, method)(request, timeout=5)
    except grpc.RpcError:
        return None


def npu_capacity(core: Any, node_name: str) -> int:
    """The node's allocatable ember.dev/npu as the API server has it (0 when absent)."""
    status = core.read_node(node_name).status
    allocatable = (status.allocatable if status else None) or {}
    return int(allocatable.get(RESOURCE, "0"))
