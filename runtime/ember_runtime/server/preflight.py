"""The server's memory check before it loads anything: the config's own figure
(`memory.replica_memory`, the rule the operator sized the pod with, from the same config)
against the container's cgroup limit."""

from __future__ import annotations

from pathlib import Path

from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.manifest import resolve_model_path
from ember_runtime.engines.embedding import check_pooling
from ember_runtime.memory import (
    EngineMemory,
    cgroup_memory_limit,
    check_limit,
    offload_for,
    read_gguf_shape,
    replica_memory,
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
    draft = config.draft_file()
    drafter = read_gguf_shape(resolve_model_path(config, draft)) if draft is not None else None
    need = replica_memory(config, shape, draft=drafter)
    prewarmed = config.prewarm_dir is not None and model.is_relative_to(config.prewarm_dir)
    weights = 0 if prewarmed else offload_for(config, shape.layers).split(model.stat().st_size)[0]
    check_limit(need, weights, cgroup_memory_limit(cgroup_root))
    return need
