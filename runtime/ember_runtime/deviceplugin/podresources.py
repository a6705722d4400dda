"""Release context IDs of containers that are gone, using the kubelet's PodResources API.

The kubelet is the authority on which container holds which unit. A failed or timed-out List
releases nothing: the safe error is to hold an ID too long, never to free a live one. For the
same reason a kubelet that has just restarted is not believed when it leaves a container out:
until it has re-admitted its pods its List is incomplete, so for the grace period after a new
kubelet appears, bound IDs are released only on proof (their units allocated again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import grpc

from .allocator import Allocation, ContextAllocator
from .api import podresources_pb2 as pr
from .api import podresources_pb2_grpc as pr_grpc

log = logging.getLogger(__name__)


class PodResourcesClient:
    def __init__(self, socket: Path, timeout: float = 5.0) -> None:
        self._socket = socket
        self._timeout = timeout

    def instance(self) -> tuple[int, int] | None:
        """Which kubelet serves the socket: a restarted kubelet recreates it (a new ctime, even
        where the filesystem hands out the same inode number again); None when it is absent."""
        try:
            st = os.stat(self._socket)
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    async def owners(self, resource_name: str) -> dict[str, frozenset[str]]:
        """Map "namespace/pod/container" to the units of `resource_name` it holds."""
        # A private subchannel pool: gRPC otherwise shares one subchannel per address across
        # channels, and after a kubelet restart that subchannel sits in reconnect backoff, so
        # the first Lists against the new, healthy socket would still fail UNAVAILABLE.
        async with grpc.aio.insecure_channel(
            f"unix://{self._socket}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            resp: pr.ListPodResourcesResponse = await stub.List(
                pr.ListPodResourcesRequest(), timeout=self._timeout
            )
        owners: dict[str, set[str]] = defaultdict(set)
        for pod in resp.pod_resources:
            for container in pod.containers:
                for devs in container.devices:
                    if devs.resource_name == resource_name:
                        key = f"{pod.namespace}/{pod.name}/{container.name}"
                        owners[key].update(devs.device_ids)
        return {k: frozenset(v) for k, v in owners.items()}


class Reconciler:
    """Runs `ContextAllocator.reconcile` against PodResources, periodically or on demand."""

    def __init__(
        self,
        client: PodResourcesClient,
        allocator: ContextAllocator,
        resource_name: str,
        grace: float,
        on_release: Callable[[list[Allocation]], None],
    ) -> None:
        self._client = client
        self._allocator = allocator
        self._resource = resource_name
        self._grace = grace
        self._on_release = on_release
        self._lock = asyncio.Lock()
        self._kubelet: tuple[int, int] | None = None
        self._trust_after = 0.0  # monotonic: a new kubelet's absences count from here on

    async def reconcile_once(self) -> list[Allocation] | None:
        """One pass; None when PodResources could not be read (nothing released then)."""
        async with self._lock:
            listed_at = time.time()  # before the call: the snapshot is at least this fresh
            self._notice_kubelet_restart()
            try:
                owners = await self._client.owners(self._resource)
            except grpc.aio.AioRpcError as exc:
                log.warning("PodResources List failed (%s); releasing nothing", exc.code())
                return None
            settling = time.monotonic() < self._trust_after
            # In a worker thread: it may write the checkpoint (fsync), and the event loop must
            # keep answering Allocate and ListAndWatch meanwhile.
            released = await asyncio.to_thread(
                self._allocator.reconcile, owners, self._grace, listed_at, keep_missing=settling
            )
        if released:
            self._on_release(released)
        return released

    def _notice_kubelet_restart(self) -> None:
        instance = self._client.instance()
        if instance is None or instance == self._kubelet:
            return
        if self._kubelet is not None:  # not our first look: the kubelet has restarted
            log.info("new kubelet: holding bound context IDs for %g s", self._grace)
            self._trust_after = time.monotonic() + self._grace
        self._kubelet = instance

    async def run(self, interval: float) -> None:
        while True:
            try:
                await self.reconcile_once()
            except OSError as exc:  # checkpoint write failed: keep serving, retry next pass
                log.error("reconcile could not write the checkpoint: %s", exc)
            await asyncio.sleep(interval)
