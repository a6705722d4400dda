"""Release context IDs of containers that are gone, using the kubelet's PodResources API.

The kubelet is the authority on which container holds which unit. A failed or timed-out List
releases nothing: the safe error is to hold an ID too long, never to free a live one.
"""

from __future__ import annotations

import asyncio
import logging
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

    async def reconcile_once(self) -> list[Allocation] | None:
        """One pass; None when PodResources could not be read (nothing released then)."""
        async with self._lock:
            listed_at = time.time()  # before the call: the snapshot is at least this fresh
            try:
                owners = await self._client.owners(self._resource)
            except grpc.aio.AioRpcError as exc:
                log.warning("PodResources List failed (%s); releasing nothing", exc.code())
                return None
            released = self._allocator.reconcile(owners, self._grace, listed_at)
        if released:
            self._on_release(released)
        return released

    async def run(self, interval: float) -> None:
        while True:
            try:
                await self.reconcile_once()
            except OSError as exc:  # checkpoint write failed: keep serving, retry next pass
                log.error("reconcile could not write the checkpoint: %s", exc)
            await asyncio.sleep(interval)
