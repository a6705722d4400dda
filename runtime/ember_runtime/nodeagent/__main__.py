"""`python -m ember_runtime.nodeagent [--flags]` (settings also from `EMBER_NODEAGENT_*`).

Samples the node's sensors every `interval_seconds`, classifies the hottest reading with the
shared policy (`ThermalPolicy.node_reason`) and writes the Node condition through the same
coalescing, retrying reporter the runtime uses. SIGTERM/SIGINT stop it cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ember_runtime.cli import configure_logging, read_settings
from ember_runtime.contract.config import SensorConfig
from ember_runtime.contract.resource import SITE_LABEL
from ember_runtime.contract.thermal import DEFAULTS, ThermalPolicy, ThermalReading, whole_degrees
from ember_runtime.kube import ConditionPatcher, Endpoint, KubeClient, node_status_path
from ember_runtime.nodeagent import windows
from ember_runtime.nodeagent.adapterviews import AdapterViews
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.evict import Evictor, pods_on_node, staged_on_node, together
from ember_runtime.nodeagent.fetcher import Fetcher, SpecResolver
from ember_runtime.nodeagent.labels import CacheLabels
from ember_runtime.nodeagent.metrics import AgentMetrics
from ember_runtime.nodeagent.peerauth import Identity
from ember_runtime.nodeagent.peerserver import PeerServer
from ember_runtime.nodeagent.podprogress import DownloadReports
from ember_runtime.nodeagent.ratelimit import TokenBucket
from ember_runtime.nodeagent.site import SiteConfig, SiteSharing
from ember_runtime.nodeagent.views import DigestViews
from ember_runtime.nodeagent.windows import Windows
from ember_runtime.reporter import ConditionReporter
from ember_runtime.sensors import build_source, sample_forever

log = logging.getLogger("ember_runtime.nodeagent")
STOP_SECONDS = 15.0  # the most a stop waits for the agent's tasks to end


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBER_NODEAGENT_", frozen=True)

    node_name: str = Field(description="This node (the downward API's spec.nodeName).")
    sysfs_root: str = "/sys"
    interval_seconds: float = Field(default=1.0, gt=0)
    # Ember's one set of thermal defaults (contract.thermal); the chart's values agree (a test).
    throttle_celsius: float = DEFAULTS.throttle_celsius
    critical_celsius: float = DEFAULTS.critical_celsius
    hysteresis_celsius: float = Field(default=DEFAULTS.hysteresis_celsius, ge=0)
    band_celsius: float = Field(
        default=DEFAULTS.celsius_per_step, gt=0, description="Report a move this large."
    )
    server: str | None = Field(default=None, description="API server URL (default: in-cluster).")
    token_file: Path | None = None
    ca_file: Path | None = None
    log_level: str = "INFO"
    cache_root: Path | None = Field(
        default=None,
        description="The node's model cache (http sources); None: fetch no models.",
    )
    namespace: str | None = Field(
        default=None, description="The agent's own namespace: where it reads origin Secrets."
    )
    retry_seconds: float = Field(default=60.0, gt=0, description="Retry a failed download.")
    mismatch_retry_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Retry a URL whose whole file hashed wrong after this long, doubling on "
        "each repeat up to 6 h (the bytes at the URL may be fixed).",
    )
    failure_seconds: float = Field(
        default=300.0,
        gt=0,
        description="A mismatch written on a site Lease stands this long (by this agent's "
        "clock) before this agent tries the URL itself.",
    )
    # Site sharing (site.py, peerauth.py): each agent makes its own peer key at start.
    site_sharing: bool = Field(
        default=False,
        description="Share cached files with the nodes of this node's site and take turns at "
        "the origin; off: every file from the origin.",
    )
    peer_port: int = Field(
        default=7431, ge=0, le=65535, description="Serve site peers here (0: any free port)."
    )
    peer_bind: str = "0.0.0.0"  # noqa: S104 - peers reach us over the node network
    peer_address: str | None = Field(
        default=None, description="host:port to advertise (default: the Node's InternalIP)."
    )
    peer_max_skew_seconds: float = Field(default=300.0, gt=0)
    site_label: str = Field(
        default=SITE_LABEL,
        description="The node label naming its site (the chart: one under "
        "node-restriction.kubernetes.io/, which a kubelet cannot set on itself).",
    )
    lease_seconds: int = Field(default=30, ge=3, description="A site fetch Lease's duration.")
    origin_wait_seconds: float = Field(
        default=600.0,
        ge=0,
        description="With the API server unreachable, wait this long for a peer before "
        "fetching from the origin without the site's Lease.",
    )
    origin_windows: list[str] = Field(
        default_factory=list,
        description="Download windows for origin traffic, HH:MM-HH:MM in UTC (may wrap "
        "midnight); empty: any time. Site peers share at any time.",
    )
    origin_max_bytes_per_second: float | None = Field(
        default=None,
        gt=0,
        description="maxBandwidth: origin traffic in bytes/s. Each agent paces its own "
        "origin downloads to it; with site sharing the site also downloads one file from the "
        "origin at a time (the site's origin slot), so it is the site's WAN use. None: "
        "unlimited, and no origin slot.",
    )

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve Prometheus /metrics here (0: any free port); None: no endpoint.",
    )
    metrics_bind: str = "0.0.0.0"  # noqa: S104 - scraped from outside the node
    cache_max_bytes: int = Field(
        default=0,
        ge=0,
        description="The cache's budget: above it, models no pod on this node names (and no "
        "rollout stages here) are evicted, least recently used first (evict.py). 0: no budget.",
    )
    evict_interval_seconds: float = Field(default=60.0, gt=0)
    label_resync_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Compare the cache with the Node's cache.ember.dev/ labels this often "
        "(a change the agent makes itself is labelled at once).",
    )

    @field_validator("origin_windows")
    @classmethod
    def _windows(cls, value: list[str]) -> list[str]:
        windows.parse(value)  # a typo fails at start, not at the first download
        return value

    def policy(self) -> ThermalPolicy:
        return ThermalPolicy(
            throttle_celsius=self.throttle_celsius,
            critical_celsius=self.critical_celsius,
            hysteresis_celsius=self.hysteresis_celsius,
        )

    def endpoint(self) -> Endpoint:
        if self.server is None:
            return Endpoint.in_cluster()
        if self.token_file is None:
            raise ValueError("--server needs --token-file")
        return Endpoint(self.server, self.token_file, self.ca_file)


def node_reading(policy: ThermalPolicy, temps: dict[str, float]) -> ThermalReading:
    hottest = max(temps.values()) if temps else None
    return ThermalReading(
        reason=policy.node_reason(hottest),
        temperature_celsius=whole_degrees(hottest),
    )


async def report_temperature(settings: AgentSettings, reporter: ConditionReporter) -> None:
    """Until cancelled: the node's hottest reading, classified, into the node's condition."""
    source = build_source(SensorConfig(sysfs_root=settings.sysfs_root))
    policy = settings.policy()

    def offer(temps: dict[str, float], _problem: str | None) -> None:
        reporter.offer(node_reading(policy, temps))

    await sample_forever(source, settings.interval_seconds, offer)


async def run(settings: AgentSettings) -> None:
    patcher = ConditionPatcher(settings.endpoint(), node_status_path(settings.node_name))
    reporter = ConditionReporter(patcher, band_celsius=settings.band_celsius)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(report_temperature(settings, reporter)),
        asyncio.create_task(reporter.run()),
    ]
    log.info("reporting %s's temperature", settings.node_name)
    metrics = AgentMetrics()
    if settings.metrics_port is not None:
        port = metrics.serve(settings.metrics_bind, settings.metrics_port)
        log.info("serving metrics on %s:%d", settings.metrics_bind, port)
    reader = KubeClient(settings.endpoint()) if settings.cache_root is not None else None
    server: PeerServer | None = None
    if settings.cache_root is not None and reader is not None:
        cache = ContentCache(settings.cache_root)
        site = None
        if settings.site_sharing:
            server, site = start_site_sharing(settings, cache, reader, metrics)
            tasks.append(asyncio.create_task(site.run()))
        labels = CacheLabels(
            cache, reader, settings.node_name, resync_seconds=settings.label_resync_seconds
        )
        tasks.append(asyncio.create_task(labels.run()))
        limiter = None
        if settings.origin_max_bytes_per_second is not None:
            limiter = TokenBucket(settings.origin_max_bytes_per_second)
        fetcher = Fetcher(
            cache,
            reader,
            settings.node_name,
            settings.namespace or "default",
            retry_seconds=settings.retry_seconds,
            mismatch_retry_seconds=settings.mismatch_retry_seconds,
            site=site,
            limiter=limiter,
            windows=Windows(settings.origin_windows) if settings.origin_windows else None,
            metrics=metrics,
            labels=labels,
        )
        tasks.append(asyncio.create_task(fetcher.run()))
        # What a replica mounts: a view per digest its pod names, never the whole cache.
        views = DigestViews(cache, lambda: fetcher.wanted().keys())
        # An http source's LoRA adapters: one view per object, its own adapters only.
        adapter_views = AdapterViews(cache, fetcher.adapter_views)
        tasks += [asyncio.create_task(views.run()), asyncio.create_task(adapter_views.run())]
        # A waiting replica's progress on its pod, live (prewarm has no way to the API).
        reports = DownloadReports(cache, reader, settings.node_name, fetcher.fetch_of)
        tasks.append(asyncio.create_task(reports.run()))
        if settings.cache_max_bytes:
            # A rollout's stage requests keep both versions: a rollback needs no WAN fetch.
            in_use = together(
                pods_on_node(reader, settings.node_name, fetcher.fetch_of),
                staged_on_node(reader, settings.node_name, SpecResolver(reader)),
            )
            evictor = Evictor(
                cache,
                views,
                in_use,
                settings.cache_max_bytes,
                interval_seconds=settings.evict_interval_seconds,
                labels=labels,
            )
            tasks.append(asyncio.create_task(evictor.run()))
        log.info("keeping models for %s's pods in %s", settings.node_name, settings.cache_root)
    try:
        await stop.wait()
        log.info("signal received; stopping")
    finally:
        for task in tasks:
            task.cancel()
        # Bounded: a task that does not end within the grace period must not keep the agent
        # (and its DaemonSet pod's termination) waiting; what it holds is left as it is.
        _, stuck = await asyncio.wait(tasks, timeout=STOP_SECONDS)
        for task in stuck:
            log.warning("stopping: %s did not end within %.0fs", task.get_name(), STOP_SECONDS)
        if server is not None:
            server.close()
        await patcher.aclose()
        if reader is not None:
            await reader.aclose()
        metrics.close()


def start_site_sharing(
    settings: AgentSettings, cache: ContentCache, reader: KubeClient, metrics: AgentMetrics
) -> tuple[PeerServer, SiteSharing]:
    """The peer port (serving from now on) and the site coordination that uses it."""
    me = Identity(settings.node_name)  # a fresh key pair each start: a restart rotates it
    site: SiteSharing | None = None

    def peer_key(node: str) -> str | None:  # only the nodes of our site, as last seen
        return site.peer_key(node) if site is not None else None

    server = PeerServer(
        cache,
        me,
        peer_key,
        settings.peer_bind,
        settings.peer_port,
        max_skew=settings.peer_max_skew_seconds,
        metrics=metrics,
    )
    server.start()
    cfg = SiteConfig(
        node=settings.node_name,
        namespace=settings.namespace or "default",
        peer_port=server.port,
        peer_address=settings.peer_address,
        lease_seconds=settings.lease_seconds,
        origin_wait_seconds=settings.origin_wait_seconds,
        failure_seconds=settings.failure_seconds,
        site_label=settings.site_label,
        # maxBandwidth is the site's: one origin download per site at a time, at that rate.
        origin_slot=settings.origin_max_bytes_per_second is not None,
    )
    # Peers are on the LAN: a short connect timeout moves on to the next one quickly.
    http = httpx.Client(timeout=httpx.Timeout(30.0, connect=3.0))
    log.info("serving cached files to site peers on %s:%d", settings.peer_bind, server.port)
    site = SiteSharing(
        cache, reader, cfg, me=me, http=http, stop=threading.Event(), metrics=metrics
    )
    return server, site


def main(argv: Sequence[str] | None = None) -> int:
    settings = read_settings(AgentSettings, argv, "node agent")
    if settings is None:
        return 2
    configure_logging(settings.log_level)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
