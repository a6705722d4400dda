"""The app factory: engine and sensors live on `app.state`, set up in the lifespan hook."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI

from ember_runtime.asgi import BodyLimit
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.manifest import resolve_model_path
from ember_runtime.contract.rollout import HealthReport
from ember_runtime.contract.thermal import ThermalReading, report_joules
from ember_runtime.engines.base import Engine, StepObserver
from ember_runtime.engines.speculative import SpecSettings
from ember_runtime.kube import ConditionPatcher, Endpoint, pod_status_path
from ember_runtime.reporter import CoalescingReporter, ConditionReporter
from ember_runtime.sensors import TemperatureSource, build_source, telemetry_of
from ember_runtime.sensors.power import MeteredSource, build_monitor
from ember_runtime.server import admin, embeddings, errors, health, routes
from ember_runtime.server.adapters import (
    AdapterReporter,
    adapter_reporter,
    adapter_specs,
    hot,
    reload_adapters,
    report_of,
)
from ember_runtime.server.metrics import Metrics
from ember_runtime.server.middleware import RequestCounter
from ember_runtime.server.settings import read_api_key
from ember_runtime.server.state import AppState
from ember_runtime.thermal import control
from ember_runtime.thermal.governor import Governor

log = logging.getLogger(__name__)


def build_engine(
    config: RuntimeConfig, model_path: Path | None, observer: StepObserver | None
) -> Engine:
    """The engine the config asks for; heavy imports happen here, not at module import."""
    if config.engine.kind == "tensorrt-llm":
        from ember_runtime.engines.trtllm import TrtLlmEngine  # noqa: PLC0415

        engine_dir = model_path or Path(config.prewarm_dir or config.model_dir)
        return TrtLlmEngine(
            engine_dir,
            context_length=config.engine.context_length,
            capacity=config.engine.max_batch_size,
            max_queue=config.server.max_queue,
            model_id=config.model_name,
        )
    if config.task == "embed":
        return _embedder(config, model_path, observer)
    from ember_runtime.engines.device_sampling import DeviceSampling  # noqa: PLC0415
    from ember_runtime.engines.llamacpp import LlamaCppEngine  # noqa: PLC0415

    modes = config.engine.llamacpp_modes()
    return LlamaCppEngine(
        resolve_model_path(config, explicit=model_path),
        context_length=config.engine.context_length,
        capacity=config.engine.max_batch_size,
        threads=config.engine.threads,
        max_queue=config.server.max_queue,
        model_id=config.model_name,
        step_tokens=config.engine.step_tokens,
        chunk_tokens=config.engine.chunk_tokens,
        deterministic=modes.deterministic,
        prefix_cache=modes.prefix_cache,
        repack=modes.repack,
        kv_unified=modes.kv_unified,
        gpu_layers=config.engine.offloaded_layers(config.accelerator),
        sampler_threads=config.engine.sampler_threads,
        device_sampling=DeviceSampling(config.engine.device_sampling),
        observer=observer,
        adapter_specs=adapter_specs(config),
        speculation=spec_settings(config),
    )


def spec_settings(config: RuntimeConfig) -> SpecSettings | None:
    """`engine.speculation` as the engine takes it; None when off."""
    spec = config.engine.speculation
    if spec.mode == "off":
        return None
    draft = config.draft_file()
    return SpecSettings(
        spec.max_draft,
        spec.ngram_min,
        spec.ngram_max,
        spec.sequences,
        draft_model=resolve_model_path(config, draft) if draft is not None else None,
    )


def _embedder(
    config: RuntimeConfig, model_path: Path | None, observer: StepObserver | None
) -> Engine:
    from ember_runtime.engines.embedding import LlamaCppEmbedder  # noqa: PLC0415

    return LlamaCppEmbedder(
        resolve_model_path(config, explicit=model_path),
        context_length=config.engine.context_length,
        capacity=config.engine.max_batch_size,
        threads=config.engine.threads,
        max_queue=config.server.max_queue,
        pooling=config.pooling,
        model_id=config.model_name,
        gpu_layers=config.engine.offloaded_layers(config.accelerator),
        observer=observer,
    )


def pod_patcher(config: RuntimeConfig) -> ConditionPatcher | None:
    """The writer of the pod's own conditions (thermal and health), when the config asks for
    them and the pod's identity is known (POD_NAME/POD_NAMESPACE from the downward API, the
    projected ServiceAccount token)."""
    name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    if not config.sensors.report_condition:
        return None
    if not name or not namespace:
        log.warning("sensors.reportCondition is on but POD_NAME/POD_NAMESPACE are not set")
        return None
    try:
        endpoint = Endpoint.in_cluster()
    except RuntimeError as exc:  # serving matters more than reporting: say so and go on
        log.warning("pod condition reports off: %s", exc)
        return None
    if not endpoint.token_file.is_file():
        log.warning("pod condition reports off: no token at %s", endpoint.token_file)
        return None
    try:
        return ConditionPatcher(endpoint, pod_status_path(namespace, name))
    except OSError as exc:  # e.g. an unreadable CA bundle
        log.warning("pod condition reports off: %s", exc)
        return None


def _thermal_reporter(config: RuntimeConfig, patcher: ConditionPatcher) -> ConditionReporter:
    return ConditionReporter(patcher, band_celsius=config.thermal.celsius_per_step)


def pod_reporters(
    config: RuntimeConfig,
    thermal: ConditionReporter | None,
    healthy: CoalescingReporter[HealthReport] | None,
) -> tuple[ConditionReporter | None, CoalescingReporter[HealthReport] | None]:
    """The given reporters, the missing ones on the pod's own patcher (one for both)."""
    thermal, healthy, _ = _pod_reporters(config, thermal, healthy, None, has_adapters=False)
    return thermal, healthy


def _pod_reporters(
    config: RuntimeConfig,
    thermal: ConditionReporter | None,
    healthy: CoalescingReporter[HealthReport] | None,
    adapters: AdapterReporter | None,
    *,
    has_adapters: bool,
) -> tuple[
    ConditionReporter | None, CoalescingReporter[HealthReport] | None, AdapterReporter | None
]:
    """`pod_reporters`, and the LoRA adapters' one (only for an engine that serves adapters:
    `has_adapters`), all on one patcher."""
    if not has_adapters:
        adapters = None
    missing = thermal is None or healthy is None or (has_adapters and adapters is None)
    patcher = pod_patcher(config) if missing else None
    if patcher is not None:
        thermal = thermal or _thermal_reporter(config, patcher)
        healthy = healthy or health.health_reporter(patcher)
        if has_adapters:
            adapters = adapters or adapter_reporter(patcher)
    return thermal, healthy, adapters


def _on_reading(
    tracker: health.HealthTracker,
    thermal: ConditionReporter | None,
    joules_per_token: Callable[[], float | None],
) -> Callable[[ThermalReading], None]:
    """Each governor decision: to the health tracker (is the batch held below capacity) and to
    the thermal condition's reporter, with the replica's joules per output token added (the
    reporter decides whether that figure alone is worth a write)."""

    def on_reading(reading: ThermalReading) -> None:
        tracker.heat(reading.reduced)
        if thermal is not None:
            figure = report_joules(joules_per_token())
            thermal.offer(dataclasses.replace(reading, joules_per_token=figure))

    return on_reading


def _reloads(
    config: RuntimeConfig,
    path: Path,
    state: AppState,
    report: ConditionReporter | None,
    adapters_report: AdapterReporter | None,
) -> list[asyncio.Task[None]]:
    """What running replicas reload from the mounted config: the thermal policy, and the LoRA
    adapters where the engine can change them live."""
    assert state.governor is not None
    tasks = [asyncio.create_task(control.reload_policy(path, state.governor, reporter=report))]
    updater = hot(state.engine)
    if updater is not None and config.task == "generate":
        reload = reload_adapters(path, updater, info=state.engine.info, reporter=adapters_report)
        tasks.append(asyncio.create_task(reload))
    return tasks


def _adapter_reports(
    config: RuntimeConfig, state: AppState, adapters_report: AdapterReporter | None
) -> list[asyncio.Task[None]]:
    """The adapters' condition: what start-up made of them (when the config lists any), then
    each change the reload loop offers."""
    if adapters_report is None:
        return []
    if config.engine.adapters:
        adapters_report.offer(report_of(state.engine.info))
    return [asyncio.create_task(adapters_report.run())]


def create_app(
    config: RuntimeConfig,
    *,
    model_path: Path | None = None,
    engine: Engine | None = None,
    sensor: TemperatureSource | None = None,
    config_path: Path | None = None,
    reporter: ConditionReporter | None = None,
    health_reporter: CoalescingReporter[HealthReport] | None = None,
    health_window_seconds: int = health.DEFAULT_WINDOW_SECONDS,
    adapters_reporter: AdapterReporter | None = None,
) -> FastAPI:
    """`config_path`: where to reload the thermal policy and the LoRA adapters from (None:
    never reload).
    `reporter`, `health_reporter`: where the thermal and health conditions go (default: the
    pod's own, see `pod_patcher`); `health_window_seconds`: the health report's window;
    `adapters_reporter`: where the LoRA adapters' condition goes (default: the pod's own)."""
    metrics = Metrics()
    chosen = engine or build_engine(config, model_path, metrics.observe_step)
    state = AppState(
        engine=chosen,
        metrics=metrics,
        request_timeout=config.server.request_timeout_seconds,
        api_key=read_api_key(config),
        sampling_defaults=config.sampling.given(),
    )
    # Smoothed (EWMA: fast attack, slow release) and NVML / npu-smi when configured; each read
    # also samples energy (RAPL and hwmon under the same sysfs root, the accelerators' power).
    energy = build_monitor(config.sensors.sysfs_root, metrics.output_tokens)
    metrics.bind_energy(energy.snapshot)
    source = MeteredSource(sensor or build_source(config.sensors), energy)
    report, health_report, adapters_report = _pod_reporters(
        config,
        reporter,
        health_reporter,
        adapters_reporter,
        has_adapters=hot(chosen) is not None and config.task == "generate",
    )
    tracker = health.HealthTracker(health_window_seconds)
    # The engine was built for engine.maxBatchSize; the governor gets the same typed value
    # (the policy applied to it), not the engine's answer about itself.
    state.governor = Governor(
        config.limits(),
        chosen.set_max_batch_size,
        report=_on_reading(tracker, report, energy.joules_per_token),
    )

    def on_sample(temps: dict[str, float]) -> None:
        state.temperatures = temps
        metrics.set_temperatures(temps)
        metrics.set_telemetry(telemetry_of(source))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.engine.start()
        metrics.bind_engine(state.engine.state)
        assert state.governor is not None
        tasks = [
            asyncio.create_task(
                control.govern(
                    source,
                    state.governor,
                    config.sensors.interval_seconds,
                    on_sample=on_sample,
                )
            )
        ]
        if config_path is not None:
            tasks += _reloads(config, config_path, state, report, adapters_report)
        tasks += _adapter_reports(config, state, adapters_report)
        if report is not None:
            tasks.append(asyncio.create_task(report.run()))
        if health_report is not None:
            tasks.append(asyncio.create_task(health_report.run()))
            tasks.append(asyncio.create_task(health.report_forever(tracker, health_report)))
        state.ready = True
        log.info("ready: serving %s", state.engine.info.model_id)
        try:
            yield
        finally:
            state.ready = False
            state.draining = True
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.engine.stop()

    app = FastAPI(title="Ember runtime", lifespan=lifespan, openapi_url="/openapi.json")
    app.state.ember = state
    app.state.health = tracker  # what the ember.dev/Health condition is read from
    errors.install(app)
    app.include_router(routes.probes)
    app.include_router(routes.api)
    app.include_router(embeddings.router)
    app.include_router(admin.router)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(BodyLimit, limit=config.server.max_body_bytes)
    # Outermost: a body BodyLimit refuses is a 413 here (the client's, not counted).
    app.add_middleware(health.HealthRecorder, tracker=tracker)
    return app
