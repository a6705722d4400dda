"""A stand-in kubelet for device plugin tests: real gRPC servers on real unix sockets.

It serves `Registration` on `<dir>/kubelet.sock` (recording every RegisterRequest), serves
`PodResourcesLister` on its own socket with an answer the test controls, and can "restart":
like the kubelet it then deletes the sockets in the device plugin dir and creates a new
`kubelet.sock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ember_runtime.deviceplugin.api import api_pb2 as pb
from ember_runtime.deviceplugin.api import api_pb2_grpc as pb_grpc
from ember_runtime.deviceplugin.api import podresources_pb2 as pr
from ember_runtime.deviceplugin.api import podresources_pb2_grpc as pr_grpc

RESOURCE = "ember.dev/npu"


@dataclass
class FakePod:
    namespace: str
    name: str
    container: str
    device_ids: list[str]
    resource: str = RESOURCE


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, harness: KubeletHarness) -> None:
        self._harness = harness

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        self._harness.registrations.append(request)
        await self._harness.register_queue.put(request)
        return pb.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, harness: KubeletHarness) -> None:
        self._harness = harness

    async def List(
        self, request: pr.ListPodResourcesRequest, context: Any
    ) -> pr.ListPodResourcesResponse:
        self._harness.pod_resources_calls += 1
        resp = pr.ListPodResourcesResponse()
        for pod in self._harness.pods:
            p = resp.pod_resources.add(name=pod.name, namespace=pod.namespace)
            c = p.containers.add(name=pod.container)
            c.devices.add(resource_name=pod.resource, device_ids=pod.device_ids)
        return resp

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: Any
    ) -> pr.AllocatableResourcesResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not played by the test kubelet")
        raise AssertionError("unreachable")

    async def Get(
        self, request: pr.GetPodResourcesRequest, context: Any
    ) -> pr.GetPodResourcesResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not played by the test kubelet")
        raise AssertionError("unreachable")


@dataclass
class KubeletHarness:
    plugin_dir: Path
    pod_resources_socket: Path
    registrations: list[pb.RegisterRequest] = field(default_factory=list)
    register_queue: asyncio.Queue[pb.RegisterRequest] = field(default_factory=asyncio.Queue)
    pods: list[FakePod] = field(default_factory=list)
    pod_resources_calls: int = 0
    _kubelet: Any = None
    _podres: Any = None

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        await self._start_kubelet()
        await self.start_pod_resources()

    async def _start_kubelet(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.kubelet_socket}")
        await server.start()
        self._kubelet = server

    async def start_pod_resources(self) -> None:
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        await server.start()
        self._podres = server

    async def stop_pod_resources(self) -> None:
        if self._podres is not None:
            await self._podres.stop(0)
            self._podres = None
            self.pod_resources_socket.unlink(missing_ok=True)

    async def restart_kubelet(self) -> None:
        """What a kubelet restart does to the plugin dir: every socket goes, a new one comes."""
        await self._kubelet.stop(0)
        for entry in self.plugin_dir.iterdir():
            if entry.is_socket():
                entry.unlink()
        await self._start_kubelet()

    async def stop(self) -> None:
        await self._kubelet.stop(0)
        await self.stop_pod_resources()

    async def next_registration(self, timeout: float) -> pb.RegisterRequest:
        return await asyncio.wait_for(self.register_queue.get(), timeout)

    @contextlib.asynccontextmanager
    async def plugin(self, socket_name: str) -> AsyncIterator[Any]:
        """A DevicePlugin client on the plugin's socket, as the kubelet dials it."""
        async with grpc.aio.insecure_channel(f"unix://{self.plugin_dir / socket_name}") as ch:
            yield pb_grpc.DevicePluginStub(ch)


def make_devices(root: Path, count: int, control: tuple[str, ...] = ()) -> None:
    """Fake device nodes: plain files, which is all discovery and health look at."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"davinci{i}").touch()
    for name in control:
        (root / name).touch()


def short_tempdir() -> Path:
    # unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))


def plugin_argv(settings: dict[str, object]) -> list[str]:
    """`python -m ember_runtime.deviceplugin` with `settings` as --kebab-case flags."""
    argv = [sys.executable, "-m", "ember_runtime.deviceplugin"]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, list):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def spawn_plugin(settings: dict[str, object], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            plugin_argv(settings), stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
