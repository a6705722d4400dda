"""Smoke tests of the real kubelet node of the local cluster: a pod runs to completion, init
containers and a native sidecar, the device plugin's sockets."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from kubernetes import client, utils

from tests.conftest import Kube, NodeHandle
from tests.support.waiting import wait_for

pytestmark = pytest.mark.node


def pod_status(kube: Kube, namespace: str, name: str) -> client.V1PodStatus:
    status = kube.core.read_namespaced_pod(name, namespace).status
    assert status is not None
    return status


def pod_phase(kube: Kube, namespace: str, name: str) -> str:
    return str(pod_status(kube, namespace, name).phase)


def test_pod_runs_to_completion_on_real_node(node: NodeHandle, kube: Kube, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hello"},
        "spec": {
            "nodeName": node.name,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": node.base_image,
                    "imagePullPolicy": "Never",
                    "command": [
                        "python3",
                        "-c",
                        "import platform; print('hello from', platform.python_version())",
                    ],
                }
            ],
        },
    }
    utils.create_from_dict(kube.api, pod, namespace=namespace)
    wait_for("pod hello Succeeded", lambda: pod_phase(kube, namespace, "hello") == "Succeeded", 90)
    logs = kube.core.read_namespaced_pod_log("hello", namespace)
    assert logs.startswith("hello from 3.")


SIDECAR = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('sidecar up', flush=True)\n"
    "while True: time.sleep(1)\n"
)


MAIN = SIDECAR.replace("'sidecar up'", "open('/work/ready').read()")


def test_init_and_native_sidecar(node: NodeHandle, kube: Kube, namespace: str) -> None:
    image = {"image": node.base_image, "imagePullPolicy": "Never"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sidecar"},
        "spec": {
            "nodeName": node.name,
            "terminationGracePeriodSeconds": 30,
            "initContainers": [
                {
                    "name": "init",
                    **image,
                    "command": ["sh", "-c", "echo prepared > /work/ready"],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                },
                {
                    "name": "side",
                    **image,
                    "restartPolicy": "Always",
                    "command": ["python3", "-c", SIDECAR],
                },
            ],
            "containers": [
                {
                    "name": "main",
                    **image,
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                    "command": ["python3", "-c", MAIN],
                }
            ],
            "volumes": [{"name": "work", "emptyDir": {"medium": "Memory"}}],
        },
    }
    utils.create_from_dict(kube.api, pod, namespace=namespace)

    def all_running() -> bool:
        status = pod_status(kube, namespace, "sidecar")
        states = (status.init_container_statuses or []) + (status.container_statuses or [])
        running = {s.name for s in states if s.state and s.state.running}
        return running >= {"side", "main"}

    wait_for("sidecar and main running", all_running, 90)

    # "Running" means the process was started, not that Python has printed yet:
    # a loaded CI machine once read main's log before its first line (empty).
    def logged(container: str, text: str) -> Callable[[], bool]:
        read = kube.core.read_namespaced_pod_log
        return lambda: text in read("sidecar", namespace, container=container)

    wait_for("main to log the init container's file", logged("main", "prepared"), 30)
    wait_for("the sidecar's first line", logged("side", "sidecar up"), 30)
    # Both handle SIGTERM, so deletion completes well inside the 30 s grace period.
    start = time.monotonic()
    kube.core.delete_namespaced_pod("sidecar", namespace)

    def gone() -> bool:
        try:
            kube.core.read_namespaced_pod("sidecar", namespace)
        except client.ApiException as exc:
            return bool(exc.status == 404)
        return False

    wait_for("pod deletion", gone, 60)
    assert time.monotonic() - start < 20


def test_device_plugin_socket_exists(node: NodeHandle) -> None:
    assert (node.device_plugin_dir / "kubelet.sock").is_socket()
    assert node.pod_resources_socket.is_socket()
