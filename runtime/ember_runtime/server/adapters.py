"""LoRA adapters hot-plugged from the mounted config (issue 47): `engine.adapters` is read again
every `RELOAD_SECONDS` beside the thermal policy, and a changed list is handed to the engine
(`LlamaCppEngine.update_adapters`), which loads the new adapters and retires the removed ones
without restarting the base. The operator leaves `engine.adapters` out of the pod template's
config hash (`RuntimeConfig.restart_relevant_yaml`), so a spec change rewrites the ConfigMap
and the kubelet refreshes the mounted file on its next pod sync (up to about a minute, the
kubelet's `syncFrequency` plus its ConfigMap cache TTL).

What the replica serves and refuses goes on its own pod as the `ember.dev/Adapters` condition
(`contract.reasons.adapters_condition`), written at start when the config lists adapters and on
each change; the operator folds it into the InferenceDeployment's `AdaptersReady` condition.

The same tick retries refused adapters whose file changed since (one the node agent had not
fetched yet shows up in the pod's adapters view: served within a tick of its arrival).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import yaml
from pydantic import ValidationError

from ember_runtime.contract.config import RuntimeConfig, load_config
from ember_runtime.contract.reasons import AdapterReport, adapters_condition
from ember_runtime.engines.base import Engine, EngineInfo
from ember_runtime.reporter import MIN_INTERVAL_SECONDS, CoalescingReporter, ConditionWriter

if TYPE_CHECKING:  # the engine's module imports numpy and llama.cpp's bindings: not at import
    from ember_runtime.engines.adapters import AdapterSpec

log = logging.getLogger(__name__)

RELOAD_SECONDS = 5.0


class HotAdapters(Protocol):
    async def update_adapters(self, specs: list[AdapterSpec]) -> bool: ...


AdapterReporter = CoalescingReporter[AdapterReport]


def adapter_reporter(
    writer: ConditionWriter, *, min_interval: float = MIN_INTERVAL_SECONDS
) -> AdapterReporter:
    """The pod's `ember.dev/Adapters` condition, written when what it says changes."""
    return CoalescingReporter(
        writer,
        worth=lambda last, new: last != new,
        condition=adapters_condition,
        what="adapters",
        min_interval=min_interval,
    )


def report_of(info: EngineInfo) -> AdapterReport:
    return AdapterReport(tuple(info.adapters), tuple(sorted(info.refused_adapters.items())))


def adapter_specs(config: RuntimeConfig) -> list[AdapterSpec]:
    """`engine.adapters` with each path resolved (relative ones under the model dir)."""
    from ember_runtime.engines.adapters import AdapterSpec  # noqa: PLC0415

    return [
        AdapterSpec(a.name, config.adapter_file(a), a.sha256, a.scale)
        for a in config.engine.adapters
    ]


def read_adapters(path: Path) -> list[AdapterSpec] | None:
    """The file's adapters; None when it cannot be read now (mid-swap, a bad edit)."""
    try:
        return adapter_specs(load_config(path))
    except (OSError, ValueError, ValidationError, yaml.YAMLError) as exc:
        log.warning("engine.adapters not reloaded from %s: %s", path, exc)
        return None


def hot(engine: Engine) -> HotAdapters | None:
    """The engine's adapter updater, if it has one (llama.cpp generating engines)."""
    return engine if hasattr(engine, "update_adapters") else None  # type: ignore[return-value]


async def reload_adapters(
    path: Path,
    engine: HotAdapters,
    *,
    info: EngineInfo | None = None,
    reporter: AdapterReporter | None = None,
    interval: float | None = None,
) -> None:
    """Until cancelled: every `interval` s (default `RELOAD_SECONDS`), serve what the file's
    `engine.adapters` says; each change is offered to `reporter` (read from `info`)."""
    while True:
        await asyncio.sleep(RELOAD_SECONDS if interval is None else interval)
        specs = await asyncio.to_thread(read_adapters, path)
        if specs is None:
            continue
        try:
            changed = await engine.update_adapters(specs)
        except Exception:  # the base keeps serving whatever went wrong here
            log.exception("updating the LoRA adapters")
            continue
        if changed and reporter is not None and info is not None:
            reporter.offer(report_of(info))
