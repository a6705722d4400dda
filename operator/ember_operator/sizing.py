"""Size a replica from its model so pods are neither OOM-killed nor starved.

OOM kills are the top field failure, so when a spec gives no `resources` the runtime container's
memory is derived from what the engine will actually allocate:

* the weights: the files themselves, which live in the memory-backed prewarm volume (tmpfs pages
  are charged to the pod) or, without prewarm, in the page cache of the mmapped hostPath files;
* the KV cache and the compute buffer: `ember_runtime.memory.engine_memory`, the one rule the
  runtime also checks against its cgroup limit at start. The engine gives each of
  `maxBatchSize` sequences its own `contextLength` cells, so the KV cache is
  layers x contextLength x maxBatchSize x KV heads x (key + value head size) x 2 bytes;
* a fixed runtime overhead (Python, the server, the engine's own allocations).

With layers offloaded to a GPU (`accelerator.kind: nvidia-gpu`, `engine.gpuLayers`), their
weights, their KV cells and the compute graph live in device memory: the pod's memory counts
only the host side (the prewarm volume, when enabled, still holds every weight in host memory),
and the device figures are reported beside it (`deviceMemory` in the ConfigMap's sizing.yaml).

The GGUF header (`ember_runtime.gguf_header`: one streaming pass, no weights, no vocabulary)
gives the exact shape; without a readable header the figures are a stated, conservative estimate.
Threads follow the CPU limit, never above it: 2 threads on 2 busy cores measured 0.38x of 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.memory import (
    GGUFShape,
    Offload,
    kv_cells,
    offload_for,
    read_gguf_shape,
    replica_memory,
)

from ember_operator import quantity
from ember_operator.api.models import InferenceDeploymentSpec, ModelFormat
from ember_operator.settings import OperatorSettings

SHM_SLACK_BYTES = 64 * quantity.MIB
# The startup probe's period: a replica is Ready within a second of its runtime answering (a
# cold start from zero waits for exactly that); its failure threshold covers the load time.
STARTUP_PERIOD_SECONDS = 1


def find_gguf_shape(
    spec: InferenceDeploymentSpec, settings: OperatorSettings, path: str | None = None
) -> GGUFShape | None:
    """Find the model's GGUF file (or the file at `path`, the draft model) where this operator
    can read it, else None (estimate)."""
    if spec.model.format != ModelFormat.GGUF:
        return None
    roots = list(settings.model_roots)
    if spec.model.source.host_path is not None:
        roots.insert(0, Path(spec.model.source.host_path.path))
    for file in spec.model.files:
        if not file.path.endswith(".gguf") or path not in (None, file.path):
            continue
        for root in roots:
            candidate = root / file.path
            try:
                if candidate.is_file() and candidate.stat().st_size == file.size_bytes:
                    return read_gguf_shape(candidate)
            except (OSError, ValueError):
                continue
    return None


@dataclass(frozen=True)
class Sizing:
    """Every computed figure, shown verbatim in the rendered ConfigMap. `kv_cache_bytes`,
    `compute_buffer_bytes` and `memory_bytes` are host memory; `device_*` GPU memory."""

    source: str  # "gguf-header" | "estimate" | "user"
    model_bytes: int
    shared_memory_bytes: int
    kv_cache_bytes: int
    compute_buffer_bytes: int
    overhead_bytes: int
    memory_bytes: int
    cpu: str
    threads: int
    startup_period_seconds: int
    startup_failure_threshold: int
    shape: GGUFShape | None = None
    gpu_layers: int = 0
    device_weights_bytes: int = 0
    device_kv_cache_bytes: int = 0
    device_compute_buffer_bytes: int = 0

    @property
    def device_memory_bytes(self) -> int:
        return (
            self.device_weights_bytes
            + self.device_kv_cache_bytes
            + self.device_compute_buffer_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory"] = quantity.format_bytes(self.memory_bytes)
        data["sharedMemory"] = quantity.format_bytes(self.shared_memory_bytes)
        if not self.gpu_layers:
            # CPU replicas keep the figures (and so the config hash) they had before offload.
            for key in ("gpu_layers", *(k for k in list(data) if k.startswith("device_"))):
                del data[key]
            return data
        data["device_memory_bytes"] = self.device_memory_bytes
        data["deviceMemory"] = quantity.format_bytes(quantity.ceil_mib(self.device_memory_bytes))
        return data


def _estimate(model_bytes: int, cells: int) -> tuple[int, int]:
    """No header: assume a 7B-class KV footprint scaled by size and a 262k-vocab compute buffer."""
    per_token = max(32 * 1024, int(512 * 1024 * min(1.0, model_bytes / 4e9)))
    return per_token * cells, 512 * quantity.MIB + 16 * quantity.MIB


def _engine_need(
    config: RuntimeConfig,
    shape: GGUFShape | None,
    total: int,
    overhead: int,
    offload: Offload,
    *,
    draft: GGUFShape | None = None,
) -> tuple[int, int, int, int]:
    """(host KV, host compute, device KV, device compute) bytes for one replica."""
    if shape is not None:  # the runtime checks the same figure, from the same config, at start
        need = replica_memory(config, shape, overhead, draft)
        return need.kv_cache, need.compute_buffer, need.device_kv_cache, need.device_compute_buffer
    kv, buf = _estimate(total, kv_cells(config.engine.context_length, config.engine.max_batch_size))
    host_kv, device_kv = offload.split(kv)
    # No header, no split of the buffer: the whole of it on each side that runs layers.
    return host_kv, buf, device_kv, buf if offload.device else 0


def shared_memory_bytes(spec: InferenceDeploymentSpec) -> int:
    """The memory-backed volume's size: the spec's limit or the files plus slack."""
    if not spec.prewarm.enabled:
        return 0
    if spec.prewarm.shared_memory_limit is not None:
        return int(quantity.parse(spec.prewarm.shared_memory_limit))
    return quantity.ceil_mib(model_bytes(spec) + SHM_SLACK_BYTES)


def model_bytes(spec: InferenceDeploymentSpec) -> int:
    return sum(f.size_bytes for f in spec.model.files)


def cpu_for(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> Fraction:
    res = spec.resources
    if res is not None:
        for table in (res.limits, res.requests):
            if "cpu" in table:
                return quantity.parse(table["cpu"])
    return quantity.parse(settings.default_cpu)


def threads_for(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> int:
    return spec.engine.threads or max(1, math.floor(cpu_for(spec, settings)))


def compute(
    spec: InferenceDeploymentSpec,
    config: RuntimeConfig,
    settings: OperatorSettings,
    shape: GGUFShape | None,
    draft: GGUFShape | None = None,
) -> Sizing:
    """Pure: the sizing of one replica from its spec, the runtime config rendered from it (what
    the engine will allocate) and (when readable) its GGUF header and its draft model's. A
    draft model's header that cannot be read here is sized as the served model's estimate."""
    total = model_bytes(spec)
    shm = shared_memory_bytes(spec)
    overhead = settings.runtime_overhead_mib * quantity.MIB
    offload = offload_for(config, shape.layers if shape is not None else None)
    if draft is None and shape is not None and config.draft_file() is not None:
        shape = None  # the runtime's check counts the draft's cells: no header, no figure
    kv, buf, device_kv, device_buf = _engine_need(
        config, shape, total, overhead, offload, draft=draft
    )
    host_weights, device_weights = offload.split(total)
    # The prewarm volume holds every weight in host memory; without it, the page cache of the
    # mmapped files the CPU layers read.
    weights = shm if spec.prewarm.enabled else host_weights
    memory = quantity.ceil_mib(int((weights + kv + buf + overhead) * settings.memory_headroom))
    cpu = cpu_for(spec, settings)
    load_seconds = total / (settings.min_load_bandwidth_mib_s * quantity.MIB)
    failures = math.ceil((settings.startup_base_seconds + load_seconds) / STARTUP_PERIOD_SECONDS)
    source = (
        "user"
        if spec.resources is not None
        else ("gguf-header" if shape is not None else "estimate")
    )
    return Sizing(
        source=source,
        model_bytes=total,
        shared_memory_bytes=shm,
        kv_cache_bytes=kv,
        compute_buffer_bytes=buf,
        overhead_bytes=overhead,
        memory_bytes=memory,
        cpu=quantity.format_cpu(cpu),
        threads=config.engine.threads,
        startup_period_seconds=STARTUP_PERIOD_SECONDS,
        startup_failure_threshold=max(3, failures),
        shape=shape,
        gpu_layers=config.engine.offloaded_layers(config.accelerator),
        device_weights_bytes=device_weights,
        device_kv_cache_bytes=device_kv,
        device_compute_buffer_bytes=device_buf,
    )
