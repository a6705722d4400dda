"""Wire discovery, health, allocator, server, watcher and reconciler into one running plugin."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from .allocator import Allocation, Checkpoint, ContextAllocator
from .config import PluginSettings
from .discovery import DeviceSource, DevNodeDiscovery
from .health import CommandProbe, HealthMonitor
from .metrics import PluginMetrics
from .podresources import PodResourcesClient, Reconciler
from .server import DevicePluginServicer, PluginServer, register
from .watch import KubeletWatcher

log = logging.getLogger(__name__)


class NpuDevicePlugin:
    def __init__(self, settings: PluginSettings, source: DeviceSource | None = None) -> None:
        self.settings = settings
        self.source = source or DevNodeDiscovery(
            settings.dev_root, settings.device_glob, settings.control_nodes
        )
        probe = (
            CommandProbe(settings.health_command, settings.health_timeout_seconds)
            if settings.health_command
            else None
        )
        self.monitor = HealthMonitor(
            self.source, probe, settings.rescan_interval_seconds, settings.health_interval_seconds
        )
        self.allocator = ContextAllocator(
            Checkpoint(settings.checkpoint_path),
            settings.id_space,
            settings.node_ordinal,
            on_release=self._count_released,  # gauges: the metrics loop, within 1 s
        )
        self.metrics = PluginMetrics()
        self.reconciler = Reconciler(
            PodResourcesClient(settings.pod_resources_socket),
            self.allocator,
            settings.resource_name,
            settings.release_grace_seconds,
            self._on_release,
        )
        servicer = DevicePluginServicer(
            settings,
            self.source,
            self.monitor,
            self.allocator,
            self.metrics,
            relief=self.reconciler.reconcile_once,
        )
        self.server = PluginServer(servicer, settings.plugin_socket)
        self.registered = asyncio.Event()
        self.metrics_port: int | None = None
        self._need_register = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.server.start()
        if self.settings.metrics_enabled:
            self.metrics_port = self.metrics.serve(
                self.settings.metrics_host, self.settings.metrics_port
            )
        watcher = KubeletWatcher(
            self.settings.kubelet_socket, self.server.socket_alive, self._on_kubelet_restart
        )
        self._need_register.set()
        for coro in (
            self.monitor.run(),
            watcher.run(),
            self._register_loop(),
            self.reconciler.run(self.settings.reconcile_interval_seconds),
            self._metrics_loop(),
        ):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.server.stop()
        self.allocator.close()
        self.metrics.close()

    async def _on_kubelet_restart(self) -> None:
        self.registered.clear()
        if not self.server.socket_alive():
            await self.server.stop(grace=0)
            await self.server.start()
        self._need_register.set()

    async def _register_loop(self) -> None:
        while True:
            await self._need_register.wait()
            self._need_register.clear()
            try:
                await register(self.settings)
            except grpc.aio.AioRpcError as exc:
                self.metrics.registrations.labels("error").inc()
                log.warning("registration with the kubelet failed (%s); retrying", exc.code())
                await asyncio.sleep(self.settings.register_retry_seconds)
                self._need_register.set()
                continue
            self.metrics.registrations.labels("ok").inc()
            self.registered.set()
            log.info(
                "registered %s with the kubelet at %s",
                self.settings.resource_name,
                self.settings.kubelet_socket,
            )

    def _count_released(self, released: list[Allocation]) -> None:
        self.metrics.released.inc(sum(len(a.contexts) for a in released))

    def _on_release(self, released: list[Allocation]) -> None:
        self._count_released(released)
        self._refresh_metrics()

    def _refresh_metrics(self) -> None:
        self.metrics.observe_devices(
            self.monitor.states(),
            self.allocator.used_by_device(),
            self.settings.contexts_per_device,
        )

    async def _metrics_loop(self) -> None:
        # Gauges are cheap to recompute; a steady refresh keeps them right after any change.
        while True:
            self._refresh_metrics()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.monitor.wait_change(self.monitor.version), 1.0)
