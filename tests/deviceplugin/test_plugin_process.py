"""The plugin as a real process: `python -m ember_runtime.deviceplugin`, SIGKILL and SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from ember_runtime.deviceplugin.allocator import Checkpoint
from ember_runtime.deviceplugin.api import api_pb2 as pb

from .conftest import base_settings
from .harness import KubeletHarness, spawn_plugin

SOCKET = "ember-npu.sock"


def settings_for(
    workdir: Path, devroot: Path, kubelet: KubeletHarness, **extra: Any
) -> dict[str, Any]:
    return base_settings(workdir, devroot, kubelet) | {"reconcile_interval_seconds": 0.2} | extra


async def allocate_ids(kubelet: KubeletHarness, units: list[str]) -> list[int]:
    ids = []
    async with kubelet.plugin(SOCKET) as stub:
        for unit in units:
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=[unit])
            resp = await stub.Allocate(req, timeout=5)
            ids.append(int(resp.container_responses[0].envs["ACL_CONTEXT_ID"]))
    return ids


def stop(proc: subprocess.Popen[bytes], sig: int) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=10)


@pytest.mark.asyncio(loop_scope="session")
async def test_sigkill_and_restart_never_reissues_live_ids(
    workdir: Path, devroot: Path, kubelet: KubeletHarness
) -> None:
    # 8 units, 8 IDs: a restarted plugin that forgot its state would hand out 0.. again.
    settings = settings_for(workdir, devroot, kubelet, id_space=8, release_grace_seconds=600)
    log = workdir / "plugin.log"
    first = spawn_plugin(settings, log)
    try:
        await kubelet.next_registration(timeout=20)
        before = await allocate_ids(kubelet, ["davinci0-ctx0", "davinci0-ctx1", "davinci0-ctx2"])
    finally:
        assert stop(first, signal.SIGKILL) == -signal.SIGKILL
    assert (kubelet.plugin_dir / SOCKET).exists()  # a SIGKILLed plugin leaves its socket

    second = spawn_plugin(settings, log)
    try:
        await kubelet.next_registration(timeout=20)
        units = [
            "davinci0-ctx3",
            "davinci1-ctx0",
            "davinci1-ctx1",
            "davinci1-ctx2",
            "davinci1-ctx3",
        ]
        after = await allocate_ids(kubelet, units)
        assert not set(before) & set(after), (before, after)
        assert sorted(before + after) == list(range(8))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # all 8 live: exhausted, no reuse
            await allocate_ids(kubelet, ["davinci0-ctx0"])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert second.poll() is None  # still serving
    finally:
        assert stop(second, signal.SIGTERM) == 0, log.read_text()


@pytest.mark.asyncio(loop_scope="session")
async def test_sigterm_removes_socket_and_keeps_checkpoint(
    workdir: Path, devroot: Path, kubelet: KubeletHarness
) -> None:
    settings = settings_for(workdir, devroot, kubelet)
    proc = spawn_plugin(settings, workdir / "plugin.log")
    try:
        await kubelet.next_registration(timeout=20)
        await allocate_ids(kubelet, ["davinci0-ctx0"])
    finally:
        code = stop(proc, signal.SIGTERM)
    assert code == 0, (workdir / "plugin.log").read_text()
    assert not (kubelet.plugin_dir / SOCKET).exists()
    live = Checkpoint(Path(settings["checkpoint_path"])).load().allocations
    assert [a.units for a in live] == [["davinci0-ctx0"]]
    # Start-up objects left the collector's full passes once serving began (ember_runtime.heap).
    assert re.search(r"froze [1-9]\d+ start-up objects", (workdir / "plugin.log").read_text())


def test_corrupt_checkpoint_refuses_to_start(workdir: Path, devroot: Path) -> None:
    checkpoint = workdir / "allocations.json"
    checkpoint.write_text('{"version": 1, "checksum": "00"}\n{"cursor": 0, "allocations": []}')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ember_runtime.deviceplugin",
            "--device-plugin-dir",
            str(workdir / "dp"),
            "--dev-root",
            str(devroot),
            "--checkpoint-path",
            str(checkpoint),
            "--no-metrics-enabled",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    assert "checksum mismatch" in proc.stderr and "refusing to start" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--contexts-per-device", "0"], "contexts_per_device"),
        (["--resource-name", "no slash"], "resource_name"),
        (["--socket-name", "kubelet.sock"], "kubelet.sock"),
    ],
)
def test_bad_flags_give_clear_errors(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ember_runtime.deviceplugin", *flags],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    assert "invalid device plugin settings" in proc.stderr and message in proc.stderr
