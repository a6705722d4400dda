"""The server's memory check before it loads anything (`memory.py` holds the sizing rule; this
reads the runtime config, which itself imports `memory`'s defaults: kept apart, no circle)."""

from __future__ import annotations

from pathlib import Path

from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.engines.embedding import check_pooling
from ember_runtime.memory import (
    EngineMemory,
    Offload,
    cgroup_memory_limit,
    check_limit,
    embedding_memory,
    engine_memory,
    read_gguf_shape,
)


def preflight(config: RuntimeConfig, model: Path, cgroup_root: Path) -> EngineMemory | None:
    """Before loading anything: refuse to start when the engine cannot fit in this container,
    or (model.task embed) when neither the spec nor the GGUF names a pooling.

    Only for GGUF models on the llama.cpp engine (None otherwise). Weights served from the
    prewarm volume are charged to the pod, not to this container, so they do not count here;
    nor do offloaded layers' weights and KV cells, which live in device memory.
    """
    if config.engine.kind != "llamacpp" or model.suffix != ".gguf":
        return None
    if config.task == "embed":
        check_pooling(model, config.pooling)  # a ValueError says to set model.pooling
    shape = read_gguf_shape(model)
    offload = Offload.of(config.engine.offloaded_layers(config.accelerator), shape.layers)
    need = (
        embedding_memory(shape, context=config.engine.context_length, offload=offload)
        if config.task == "embed"
        else engine_memory(
            shape,
            context=config.engine.context_length,
            sequences=config.engine.max_batch_size,
            step_tokens=config.engine.step_tokens,
            unified=config.engine.llamacpp_modes().kv_unified,
            offload=offload,
        )
    )
    prewarmed = config.prewarm_dir is not None and model.is_relative_to(config.prewarm_dir)
    weights = 0 if prewarmed else offload.split(model.stat().st_size)[0]
    check_limit(need, weights, cgroup_memory_limit(cgroup_root))
    return need
