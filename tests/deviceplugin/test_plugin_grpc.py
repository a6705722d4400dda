"""The plugin against a stand-in kubelet: real gRPC over real unix sockets, in one process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from ember_runtime.deviceplugin.api import api_pb2 as pb

from tests.support.waiting import wait_async

from .conftest import PluginFactory
from .harness import RESOURCE, FakePod, KubeletHarness

pytestmark = pytest.mark.asyncio(loop_scope="session")

SOCKET = "ember-npu.sock"


async def allocate(stub: Any, *requests: list[str]) -> pb.AllocateResponse:
    req = pb.AllocateRequest()
    for units in requests:
        req.container_requests.add(devices_ids=units)
    resp: pb.AllocateResponse = await stub.Allocate(req, timeout=5)
    return resp


def health_of(resp: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in resp.devices}


async def test_registration_payload(start_plugin: PluginFactory, kubelet: KubeletHarness) -> None:
    await start_plugin(contexts_per_device=3)
    reg = await kubelet.next_registration(timeout=5)
    assert reg.version == "v1beta1"
    assert reg.endpoint == SOCKET
    assert reg.resource_name == RESOURCE
    assert reg.options.get_preferred_allocation_available
    assert not reg.options.pre_start_required
    assert (kubelet.plugin_dir / reg.endpoint).is_socket()
    async with kubelet.plugin(reg.endpoint) as stub:
        opts = await stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert opts.get_preferred_allocation_available


async def test_list_and_watch_reports_health_flips_and_recovery(
    start_plugin: PluginFactory, kubelet: KubeletHarness, devroot: Path
) -> None:
    await start_plugin(contexts_per_device=4, rescan_interval_seconds=30)  # inotify must do it
    async with kubelet.plugin(SOCKET) as stub:
        stream = stub.ListAndWatch(pb.Empty())
        first = health_of(await asyncio.wait_for(stream.read(), 5))
        assert first == {f"davinci{d}-ctx{c}": "Healthy" for d in range(2) for c in range(4)}

        (devroot / "davinci1").unlink()
        flipped = health_of(await asyncio.wait_for(stream.read(), 1.0))
        assert {u for u, h in flipped.items() if h == "Unhealthy"} == {
            f"davinci1-ctx{c}" for c in range(4)
        }
        assert all(flipped[f"davinci0-ctx{c}"] == "Healthy" for c in range(4))

        (devroot / "davinci1").touch()
        recovered = health_of(await asyncio.wait_for(stream.read(), 1.0))
        assert set(recovered.values()) == {"Healthy"}

        (devroot / "davinci2").touch()  # hot-added NPU shows up too
        grown = health_of(await asyncio.wait_for(stream.read(), 1.0))
        assert grown["davinci2-ctx3"] == "Healthy" and len(grown) == 12
        stream.cancel()


async def test_health_command_marks_and_recovers(
    start_plugin: PluginFactory, kubelet: KubeletHarness, workdir: Path
) -> None:
    bad = workdir / "bad-devices"
    bad.write_text("")
    script = workdir / "npu-health"
    script.write_text(f'#!/bin/sh\nif grep -qx "$1" {bad}; then exit 1; fi\nexit 0\n')
    script.chmod(0o755)
    await start_plugin(
        contexts_per_device=1, health_command=[str(script), "{name}"], health_interval_seconds=0.2
    )
    async with kubelet.plugin(SOCKET) as stub:
        stream = stub.ListAndWatch(pb.Empty())
        assert set(health_of(await asyncio.wait_for(stream.read(), 5)).values()) == {"Healthy"}
        bad.write_text("davinci0\n")
        sick = health_of(await asyncio.wait_for(stream.read(), 1.0))
        assert sick == {"davinci0-ctx0": "Unhealthy", "davinci1-ctx0": "Healthy"}
        bad.write_text("")
        well = health_of(await asyncio.wait_for(stream.read(), 1.0))
        assert set(well.values()) == {"Healthy"}
        stream.cancel()


async def test_allocate_envs_and_device_specs(
    start_plugin: PluginFactory, kubelet: KubeletHarness, devroot: Path
) -> None:
    await start_plugin(contexts_per_device=4)
    async with kubelet.plugin(SOCKET) as stub:
        resp = await allocate(stub, ["davinci1-ctx2"], ["davinci0-ctx0", "davinci1-ctx0"])
    single, multi = resp.container_responses
    assert single.envs["ASCEND_VISIBLE_DEVICES"] == "1"
    assert single.envs["ASCEND_DEVICE_ID"] == "1"
    ctx = int(single.envs["ACL_CONTEXT_ID"])
    assert single.envs["EMBER_NPU_CONTEXT"] == f"1:{ctx}"
    specs = {d.container_path: (d.host_path, d.permissions) for d in single.devices}
    assert specs == {
        "/dev/davinci1": (str(devroot / "davinci1"), "rw"),
        "/dev/davinci_manager": (str(devroot / "davinci_manager"), "rw"),
        "/dev/devmm_svm": (str(devroot / "devmm_svm"), "rw"),
    }  # hisi_hdc does not exist, so it is not handed out

    assert multi.envs["ASCEND_VISIBLE_DEVICES"] == "0,1"
    ids = [int(x) for x in multi.envs["ACL_CONTEXT_ID"].split(",")]
    assert len(set(ids)) == 2 and ctx not in ids
    assert multi.envs["EMBER_NPU_CONTEXT"] == f"0:{ids[0]},1:{ids[1]}"
    assert {d.container_path for d in multi.devices} >= {"/dev/davinci0", "/dev/davinci1"}


async def test_device_specs_name_host_paths_when_dev_is_mounted_elsewhere(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    # The DaemonSet sees the host's /dev at /host/dev; the container runtime needs /dev/…
    await start_plugin(host_dev_root=Path("/dev"))
    async with kubelet.plugin(SOCKET) as stub:
        resp = await allocate(stub, ["davinci0-ctx1"])
    specs = {d.container_path: d.host_path for d in resp.container_responses[0].devices}
    assert specs == {
        "/dev/davinci0": "/dev/davinci0",
        "/dev/davinci_manager": "/dev/davinci_manager",
        "/dev/devmm_svm": "/dev/devmm_svm",
    }


async def test_node_ordinal_gives_fleet_unique_range(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    await start_plugin(node_ordinal=3, id_space=100)
    async with kubelet.plugin(SOCKET) as stub:
        resp = await allocate(stub, ["davinci0-ctx0"], ["davinci0-ctx1"])
    ids = {int(c.envs["ACL_CONTEXT_ID"]) for c in resp.container_responses}
    assert len(ids) == 2 and all(300 <= i < 400 for i in ids)


async def test_200_concurrent_allocates_get_distinct_ids(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    plugin = await start_plugin(contexts_per_device=100)
    units = [f"davinci{d}-ctx{c}" for d in range(2) for c in range(100)]
    async with kubelet.plugin(SOCKET) as stub:
        resps = await asyncio.gather(*(allocate(stub, [u]) for u in units))
    ids = [int(r.container_responses[0].envs["ACL_CONTEXT_ID"]) for r in resps]
    assert len(set(ids)) == 200
    assert plugin.allocator.live_ids() == set(ids)


async def test_kubelet_restart_reregisters_within_2s(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    await start_plugin()
    await kubelet.next_registration(timeout=5)
    await kubelet.restart_kubelet()  # removes our socket, recreates kubelet.sock
    started = time.monotonic()
    reg = await kubelet.next_registration(timeout=2.0)
    assert time.monotonic() - started < 2.0
    assert reg.endpoint == SOCKET and (kubelet.plugin_dir / SOCKET).is_socket()
    async with kubelet.plugin(SOCKET) as stub:  # the new socket serves
        first = await asyncio.wait_for(stub.ListAndWatch(pb.Empty()).read(), 5)
        assert len(first.devices) == 8


async def test_ids_reused_only_after_podresources_shows_pod_gone(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    plugin = await start_plugin(id_space=3, release_grace_seconds=300)
    async with kubelet.plugin(SOCKET) as stub:
        units = ["davinci0-ctx0", "davinci0-ctx1", "davinci1-ctx0"]
        ids = []
        for i, unit in enumerate(units):
            resp = await allocate(stub, [unit])
            ids.append(int(resp.container_responses[0].envs["ACL_CONTEXT_ID"]))
            kubelet.pods.append(FakePod("ns", f"pod{i}", "main", [unit]))
        assert sorted(ids) == [0, 1, 2]
        assert await plugin.reconciler.reconcile_once() == []

        with pytest.raises(grpc.aio.AioRpcError) as exhausted:  # every ID is live
            await allocate(stub, ["davinci1-ctx1"])
        assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "context IDs" in (exhausted.value.details() or "")

        gone = kubelet.pods.pop(1)  # pod1 deleted: the kubelet no longer lists it
        assert gone.device_ids == ["davinci0-ctx1"]
        # Allocate reconciles once when exhausted, so the freed ID comes back right away.
        resp = await allocate(stub, ["davinci0-ctx1"])
        assert int(resp.container_responses[0].envs["ACL_CONTEXT_ID"]) == ids[1]
    assert plugin.allocator.live_ids() == {0, 1, 2}


async def test_nothing_released_while_podresources_unreachable(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    plugin = await start_plugin(release_grace_seconds=0.3, reconcile_interval_seconds=600)
    async with kubelet.plugin(SOCKET) as stub:
        await allocate(stub, ["davinci0-ctx0"])
    await asyncio.sleep(0.4)  # past the grace period: only PodResources keeps it alive now
    await kubelet.stop_pod_resources()
    assert await plugin.reconciler.reconcile_once() is None
    assert len(plugin.allocator.live()) == 1
    await kubelet.start_pod_resources()  # reachable and empty: now it is gone
    released = await plugin.reconciler.reconcile_once()
    assert released is not None and len(released) == 1


async def test_unseen_allocation_released_after_grace_bound_one_kept(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    plugin = await start_plugin(release_grace_seconds=0.5)
    async with kubelet.plugin(SOCKET) as stub:
        await allocate(stub, ["davinci0-ctx0"])
        await allocate(stub, ["davinci1-ctx0"])
    kubelet.pods.append(FakePod("ns", "kept", "main", ["davinci1-ctx0"]))
    assert await plugin.reconciler.reconcile_once() == []  # within grace: both kept
    await asyncio.sleep(0.6)
    released = await plugin.reconciler.reconcile_once()
    assert released is not None and [a.units for a in released] == [["davinci0-ctx0"]]
    (live,) = plugin.allocator.live()
    assert live.owner == "ns/kept/main"


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([], "no container requests"),
        ([[]], "at least one device ID"),
        ([["davinci9-ctx0"]], "unknown device ID"),
        ([["davinci0-ctx99"]], "unknown device ID"),
        ([["not-a-unit"]], "not an ember NPU unit ID"),
        ([["davinci0-ctx0", "davinci0-ctx0"]], "duplicate"),
        ([["davinci0-ctx0"], ["bogus"]], "not an ember NPU unit ID"),
    ],
)
async def test_malformed_allocate_is_invalid_argument(
    start_plugin: PluginFactory,
    kubelet: KubeletHarness,
    requests: list[list[str]],
    message: str,
) -> None:
    plugin = await start_plugin()
    async with kubelet.plugin(SOCKET) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await allocate(stub, *requests)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
        # No crash, and the failed call consumed no ID (all or nothing).
        resp = await allocate(stub, ["davinci0-ctx0"])
    assert resp.container_responses[0].envs["ACL_CONTEXT_ID"] == "0"
    assert len(plugin.allocator.live()) == 1


async def test_preferred_allocation_over_grpc(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    await start_plugin()
    available = ["davinci0-ctx3", "davinci1-ctx0", "davinci1-ctx1", "davinci1-ctx2"]
    req = pb.PreferredAllocationRequest()
    req.container_requests.add(available_deviceIDs=available, allocation_size=1)
    req.container_requests.add(available_deviceIDs=available, allocation_size=3)
    req.container_requests.add(
        available_deviceIDs=available, must_include_deviceIDs=["davinci0-ctx3"], allocation_size=2
    )
    async with kubelet.plugin(SOCKET) as stub:
        resp = await stub.GetPreferredAllocation(req, timeout=5)
        one, three, anchored = (list(r.deviceIDs) for r in resp.container_responses)
        assert one == ["davinci1-ctx0"]  # the NPU with the most free contexts
        assert three == ["davinci1-ctx0", "davinci1-ctx1", "davinci1-ctx2"]  # one NPU
        assert anchored[0] == "davinci0-ctx3" and len(anchored) == 2

        bad = pb.PreferredAllocationRequest()
        bad.container_requests.add(available_deviceIDs=available, allocation_size=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetPreferredAllocation(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["x"]), timeout=5)


async def test_metrics_report_devices_and_contexts(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    plugin = await start_plugin(contexts_per_device=4)
    await kubelet.next_registration(timeout=5)
    async with kubelet.plugin(SOCKET) as stub:
        await allocate(stub, ["davinci1-ctx0"])
    url = f"http://127.0.0.1:{plugin.metrics_port}/metrics"
    used = 'ember_npu_contexts{device="davinci1",state="used"} 1.0'
    async with httpx.AsyncClient() as client:  # gauges refresh within a second

        async def metrics() -> str:
            return (await client.get(url)).text

        text = await wait_async("the used context", metrics, 3, 0.2, until=lambda t: used in t)
    assert 'ember_npu_devices{health="healthy"} 2.0' in text
    assert 'ember_npu_contexts{device="davinci1",state="free"} 3.0' in text
    assert 'ember_npu_registrations_total{result="ok"} 1.0' in text
    assert "ember_npu_allocate_seconds_count 1.0" in text


async def test_restarted_kubelet_does_not_free_live_ids_before_it_relists_pods(
    start_plugin: PluginFactory, kubelet: KubeletHarness
) -> None:
    # Found by the kubelet restart drill: a new kubelet serves PodResources before it has
    # re-admitted its pods, so its first Lists leave out containers that still run.
    plugin = await start_plugin(release_grace_seconds=0.5, reconcile_interval_seconds=600)
    async with kubelet.plugin(SOCKET) as stub:
        await allocate(stub, ["davinci0-ctx0"])
        await allocate(stub, ["davinci1-ctx0"])
    running = FakePod("ns", "running", "main", ["davinci0-ctx0"])
    exited = FakePod("ns", "exited", "main", ["davinci1-ctx0"])
    kubelet.pods = [running, exited]
    assert await plugin.reconciler.reconcile_once() == []  # both bound to their pods

    await kubelet.stop_pod_resources()  # the kubelet restarts: a new socket, no pods yet
    kubelet.pods = []
    await kubelet.start_pod_resources()
    assert await plugin.reconciler.reconcile_once() == []
    assert plugin.allocator.live_ids() == {0, 1}

    kubelet.pods = [running]  # re-admitted; "exited" ended while the kubelet was down
    assert await plugin.reconciler.reconcile_once() == []  # still settling: kept
    await asyncio.sleep(0.6)
    released = await plugin.reconciler.reconcile_once()
    assert released is not None and [a.owner for a in released] == ["ns/exited/main"]
    assert plugin.allocator.live_ids() == {0}
