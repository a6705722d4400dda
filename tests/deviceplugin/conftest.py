"""Fixtures for the device plugin tests; generates the gRPC stubs if `make protos` has not."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

if importlib.util.find_spec("ember_runtime.deviceplugin.api.api_pb2") is None or (
    importlib.util.find_spec("ember_runtime.deviceplugin.api.podresources_pb2") is None
):
    from ember_runtime.deviceplugin.api.generate import generate

    generate()

from ember_runtime.deviceplugin.config import PluginSettings
from ember_runtime.deviceplugin.plugin import NpuDevicePlugin

from .harness import KubeletHarness, make_devices, short_tempdir

CONTROL_PRESENT = ("davinci_manager", "devmm_svm")  # hisi_hdc deliberately absent


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tempdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def devroot(workdir: Path) -> Path:
    root = workdir / "dev"
    make_devices(root, 2, CONTROL_PRESENT)
    return root


@pytest_asyncio.fixture
async def kubelet(workdir: Path) -> AsyncIterator[KubeletHarness]:
    harness = KubeletHarness(workdir / "device-plugins", workdir / "pod-resources.sock")
    await harness.start()
    yield harness
    await harness.stop()


def base_settings(workdir: Path, devroot: Path, kubelet: KubeletHarness) -> dict[str, Any]:
    return {
        "device_plugin_dir": kubelet.plugin_dir,
        "pod_resources_socket": kubelet.pod_resources_socket,
        "dev_root": devroot,
        "checkpoint_path": workdir / "state" / "allocations.json",
        "metrics_port": 0,
        "metrics_host": "127.0.0.1",
        "register_retry_seconds": 0.2,
    }


PluginFactory = Callable[..., Awaitable[NpuDevicePlugin]]


@pytest_asyncio.fixture
async def start_plugin(
    workdir: Path, devroot: Path, kubelet: KubeletHarness
) -> AsyncIterator[PluginFactory]:
    """Start an in-process plugin with overrides; every one started is stopped afterwards."""
    started: list[NpuDevicePlugin] = []

    async def factory(**overrides: Any) -> NpuDevicePlugin:
        values = base_settings(workdir, devroot, kubelet) | overrides
        plugin = NpuDevicePlugin(PluginSettings(**values))
        await plugin.start()
        started.append(plugin)
        return plugin

    yield factory
    for plugin in started:
        await plugin.stop()
