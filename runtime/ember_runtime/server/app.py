"""The app factory: engine and sensors live on `app.state`, set up in the lifespan hook."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI

from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.engines.base import Engine, StepObserver
from ember_runtime.kube import ConditionPatcher, Endpoint, pod_status_path
from ember_runtime.prewarm.manifest import resolve_model_path
from ember_runtime.sensors import TemperatureSource, build_source, telemetry_of
from ember_runtime.server import admin, embeddings, errors, routes
from ember_runtime.server.metrics import Metrics
from ember_runtime.server.middleware import BodyLimit, RequestCounter
from ember_runtime.server.settings import read_api_key
from ember_runtime.server.state import AppState
from ember_runtime.thermal import control
from ember_runtime.thermal.governor import Governor
from ember_runtime.thermal.reporter import ConditionReporter

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
        deterministic=modes.deterministic,
        prefix_cache=modes.prefix_cache,
        repack=modes.repack,
        kv_unified=modes.kv_unified,
        gpu_layers=config.engine.offloaded_layers(config.accelerator),
        sampler_threads=config.engine.sampler_threads,
        device_sampling=DeviceSampling(config.engine.device_sampling),
        observer=observer,
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


def pod_reporter(config: RuntimeConfig) -> ConditionReporter | None:
    """The pod condition reporter, when the config asks for one and the pod's identity is known
    (POD_NAME/POD_NAMESPACE from the downward API, the projected ServiceAccount token)."""
    name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    if not config.sensors.report_condition:
        return None
    if not name or not namespace:
        log.warning("sensors.reportCondition is on but POD_NAME/POD_NAMESPACE are not set")
        return None
    try:
        endpoint = Endpoint.in_cluster()
    except RuntimeError as exc:  # serving matters more than reporting: say so and go on
        log.warning("thermal condition reports off: %s", exc)
        return None
    if not endpoint.token_file.is_file():
        log.warning("thermal condition reports off: no token at %s", endpoint.token_file)
        return None
    try:
        patcher = ConditionPatcher(endpoint, pod_status_path(namespace, name))
    except OSError as exc:  # e.g. an unreadable CA bundle
        log.warning("thermal condition reports off: %s", exc)
        return None
    return ConditionReporter(patcher, band_celsius=config.thermal.celsius_per_step)


def create_app(
    config: RuntimeConfig,
    *,
    model_path: Path | None = None,
    engine: Engine | None = None,
    sensor: TemperatureSource | None = None,
    config_path: Path | None = None,
    reporter: ConditionReporter | None = None,
) -> FastAPI:
    """`config_path`: where to reload the thermal policy from (None: never reload).
    `reporter`: where the thermal condition goes (default: `pod_reporter(config)`)."""
    metrics = Metrics()
    chosen = engine or build_engine(config, model_path, metrics.observe_step)
    state = AppState(
        engine=chosen,
        metrics=metrics,
        request_timeout=config.server.request_timeout_seconds,
        api_key=read_api_key(config),
    )
    # Smoothed (EWMA: fast attack, slow release) and NVML / npu-smi when configured.
    source = sensor or build_source(config.sensors)
    report = reporter if reporter is not None else pod_reporter(config)
    # The engine was built for engine.maxBatchSize; the governor gets the same typed value
    # (the policy applied to it), not the engine's answer about itself.
    state.governor = Governor(
        config.limits(),
        chosen.set_max_batch_size,
        report=report.offer if report is not None else None,
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
            tasks.append(
                asyncio.create_task(
                    control.reload_policy(config_path, state.governor, reporter=report)
                )
            )
        if report is not None:
            tasks.append(asyncio.create_task(report.run()))
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
    errors.install(app)
    app.include_router(routes.probes)
    app.include_router(routes.api)
    app.include_router(embeddings.router)
    app.include_router(admin.router)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(BodyLimit, limit=config.server.max_body_bytes)
    return app
