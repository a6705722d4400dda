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
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from ember_runtime.config import SensorSettings, ThermalPolicy, ThermalReading
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import Fetcher, KubeReader
from ember_runtime.sensors import build_source
from ember_runtime.sensors.base import TemperatureSource
from ember_runtime.thermal.kube import ConditionPatcher, Endpoint, node_status_path
from ember_runtime.thermal.reporter import ConditionReporter

log = logging.getLogger("ember_runtime.nodeagent")


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBER_NODEAGENT_", frozen=True)

    node_name: str = Field(description="This node (the downward API's spec.nodeName).")
    sysfs_root: str = "/sys"
    interval_seconds: float = Field(default=1.0, gt=0)
    throttle_celsius: float = 78.0
    critical_celsius: float = 90.0
    hysteresis_celsius: float = Field(default=3.0, ge=0)
    band_celsius: float = Field(default=2.0, gt=0, description="Report a move this large.")
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
        temperature_celsius=None if hottest is None else round(hottest),
    )


async def sample_forever(
    source: TemperatureSource,
    policy: ThermalPolicy,
    reporter: ConditionReporter,
    interval: float,
) -> None:
    while True:
        try:
            temps = await asyncio.to_thread(source.read)
        except Exception:  # a broken sensor is "no reading", never a crash
            log.exception("temperature read failed")
            temps = {}
        reporter.offer(node_reading(policy, temps))
        await asyncio.sleep(interval)


async def run(settings: AgentSettings) -> None:
    source = build_source(SensorSettings(sysfs_root=settings.sysfs_root))
    patcher = ConditionPatcher(settings.endpoint(), node_status_path(settings.node_name))
    reporter = ConditionReporter(patcher, band_celsius=settings.band_celsius)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(
            sample_forever(source, settings.policy(), reporter, settings.interval_seconds)
        ),
        asyncio.create_task(reporter.run()),
    ]
    log.info("reporting %s's temperature", settings.node_name)
    reader = None
    if settings.cache_root is not None:
        reader = KubeReader(settings.endpoint())
        fetcher = Fetcher(
            ContentCache(settings.cache_root),
            reader,
            settings.node_name,
            settings.namespace or "default",
            retry_seconds=settings.retry_seconds,
        )
        tasks.append(asyncio.create_task(fetcher.run()))
        log.info("keeping models for %s's pods in %s", settings.node_name, settings.cache_root)
    try:
        await stop.wait()
        log.info("signal received; stopping")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await patcher.aclose()
        if reader is not None:
            await reader.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = CliApp.run(AgentSettings, cli_args=args)
    except ValidationError as exc:
        print(f"invalid node agent settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
