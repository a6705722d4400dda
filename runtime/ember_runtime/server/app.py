"""The app factory: engine and sensors live on `app.state`, set up in the lifespan hook."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI

from ember_runtime.config import RuntimeConfig
from ember_runtime.engines.base import Engine, StepObserver
from ember_runtime.sensors import TemperatureSource, build_source
from ember_runtime.server import admin, errors, routes
from ember_runtime.server.metrics import Metrics
from ember_runtime.server.middleware import BodyLimit, RequestCounter
from ember_runtime.server.settings import read_api_key, resolve_model_path
from ember_runtime.server.state import AppState

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
    from ember_runtime.engines.llamacpp import LlamaCppEngine  # noqa: PLC0415

    modes = config.engine.llamacpp_modes()
    return LlamaCppEngine(
        resolve_model_path(config, model_path),
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
        observer=observer,
    )


def create_app(
    config: RuntimeConfig,
    *,
    model_path: Path | None = None,
    engine: Engine | None = None,
    sensor: TemperatureSource | None = None,
) -> FastAPI:
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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.engine.start()
        metrics.bind_engine(state.engine.state)
        poller = asyncio.create_task(_poll_sensors(state, source, config.sensors.interval_seconds))
        state.ready = True
        log.info("ready: serving %s", state.engine.info.model_id)
        try:
            yield
        finally:
            state.ready = False
            state.draining = True
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await state.engine.stop()

    app = FastAPI(title="Ember runtime", lifespan=lifespan, openapi_url="/openapi.json")
    app.state.ember = state
    errors.install(app)
    app.include_router(routes.probes)
    app.include_router(routes.api)
    app.include_router(admin.router)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(BodyLimit, limit=config.server.max_body_bytes)
    return app


async def _poll_sensors(state: AppState, source: TemperatureSource, interval: float) -> None:
    while True:
        try:
            temps = await asyncio.to_thread(source.read)
        except Exception:  # a broken sensor must not take serving down
            log.exception("temperature read failed")
        else:
            state.temperatures = temps
            state.metrics.set_temperatures(temps)
        await asyncio.sleep(interval)
