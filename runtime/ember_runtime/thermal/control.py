"""The runtime's thermal tasks: sample → govern, and reload the policy from the mounted
ConfigMap. Both run on the server's event loop; sensor reads go to a thread (npu-smi can take a
second). The governor reports its own decisions (its `report` callback): nothing here carries
the batch or the reading onward."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError

from ember_runtime.contract.config import load_config
from ember_runtime.contract.thermal import ThermalPolicy
from ember_runtime.reporter import ConditionReporter
from ember_runtime.sensors.base import TemperatureSource
from ember_runtime.sensors.sampler import sample_forever
from ember_runtime.thermal.governor import Governor

log = logging.getLogger(__name__)

# The kubelet refreshes a mounted ConfigMap within its sync period (~1 min); checking the file
# every few seconds adds little to that and costs one small read.
RELOAD_SECONDS = 5.0


async def govern(
    source: TemperatureSource,
    governor: Governor,
    interval: float,
    *,
    on_sample: Callable[[dict[str, float]], None] | None = None,
) -> None:
    """Until cancelled: every `interval` s, the hottest smoothed reading sets the batch limit."""

    def step(temps: dict[str, float], problem: str | None) -> None:
        if on_sample is not None:
            on_sample(temps)
        governor.apply(max(temps.values()) if temps else None, problem)

    await sample_forever(source, interval, step)


def read_policy(path: Path) -> ThermalPolicy | None:
    try:
        return load_config(path).thermal
    except (OSError, ValueError, ValidationError, yaml.YAMLError) as exc:
        # Mid-swap of the ConfigMap's symlink, or a bad edit: keep the policy in force.
        log.warning("thermal policy not reloaded from %s: %s", path, exc)
        return None


async def reload_policy(
    path: Path,
    governor: Governor,
    *,
    reporter: ConditionReporter | None = None,
    interval: float = RELOAD_SECONDS,
) -> None:
    """Until cancelled: apply a changed `thermal:` section without restarting anything."""
    current = read_policy(path)
    while True:
        await asyncio.sleep(interval)
        policy = await asyncio.to_thread(read_policy, path)
        if policy is None or policy == current:
            continue
        current = policy
        if reporter is not None:  # before the governor reports under the new policy
            reporter.band_celsius = policy.celsius_per_step
        governor.set_policy(policy)
