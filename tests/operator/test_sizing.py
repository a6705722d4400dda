"""Sizing from the real Gemma 3 270M GGUF header."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ember_operator import quantity, render, sizing
from ember_operator.api.models import parse_spec
from ember_operator.settings import OperatorSettings
from ember_runtime import memory
from ember_runtime.contract.config import ALL_LAYERS, RuntimeConfig, SpeculationConfig
from ember_runtime.server.preflight import preflight

from tests.operator.specs import manifest, rendered, size_of

MIB = 2**20


def _spec_for(path: Path, **overrides: Any) -> dict[str, Any]:
    files = [{"path": path.name, "sha256": "0" * 64, "sizeBytes": path.stat().st_size}]
    model = {"name": "gemma", "source": {"hostPath": {"path": str(path.parent)}}, "files": files}
    spec: dict[str, Any] = manifest(model=model, **overrides)["spec"]
    return spec


def test_reads_the_gemma_header(gemma_gguf: Path) -> None:
    shape = memory.read_gguf_shape(gemma_gguf)
    # Gemma 3 270M: 18 blocks, 640-wide, 4 query heads sharing 1 KV head of 256, 262k vocab.
    assert shape.architecture == "gemma3"
    assert (shape.layers, shape.embedding, shape.heads, shape.kv_heads) == (18, 640, 4, 1)
    assert shape.key_length == shape.value_length == 256
    assert shape.vocab == 262_144
    assert shape.context >= 32_768


# llama.cpp's own log ("output buffer size", "compute buffer size") for the engine's context:
# (context, sequences, one KV pool, prompt tokens per step) -> (output, compute) MiB.
LLAMA_CPP_REPORTED = {
    (2048, 16, False, 256): (16, 17.1),
    (2048, 16, False, 1024): (16, 44.2),
    (2048, 16, True, 256): (16, 43.4),
    (2048, 16, True, 1024): (16, 166.1),
    (512, 16, True, 1024): (16, 68.6),
    (512, 4, False, 256): (4, 9.5),
}


@pytest.mark.parametrize(("layout", "reported"), list(LLAMA_CPP_REPORTED.items()))
def test_buffers_match_what_llama_cpp_reports(
    gemma_gguf: Path, layout: tuple[int, int, bool, int], reported: tuple[float, float]
) -> None:
    context, sequences, unified, step = layout
    shape = memory.read_gguf_shape(gemma_gguf)
    need = memory.engine_memory(
        shape, context=context, sequences=sequences, unified=unified, step_tokens=step
    )
    # one KV cell per token of context per sequence, pooled or not (KV 96 + 480 MiB at 2048 x 16)
    assert need.kv_cache == context * sequences * 18 * 2 * 256 * 2
    low = sum(reported) * MIB
    assert low <= need.compute_buffer <= 1.5 * low  # an upper bound, and not a wasteful one


def test_memory_covers_tmpfs_weights_kv_and_compute(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    spec = parse_spec(_spec_for(gemma_gguf, engine={"contextLength": 4096}))
    shape = sizing.find_gguf_shape(spec, settings)
    assert shape is not None, "the hostPath file should be found and read"
    sized = size_of(spec, settings, shape)
    assert sized.source == "gguf-header"
    # one KV stream of contextLength cells for each of maxBatchSize (16) sequences
    assert sized.kv_cache_bytes == 18 * 4096 * 16 * 1 * (256 + 256) * 2
    assert sized.shared_memory_bytes >= gemma_gguf.stat().st_size
    floor = sized.shared_memory_bytes + sized.kv_cache_bytes + sized.compute_buffer_bytes
    assert sized.memory_bytes >= floor + settings.runtime_overhead_mib * MIB
    assert sized.memory_bytes % MIB == 0


def test_without_prewarm_the_page_cache_is_counted_instead(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    spec = parse_spec(_spec_for(gemma_gguf, prewarm={"enabled": False}))
    sized = size_of(spec, settings, sizing.find_gguf_shape(spec, settings))
    assert sized.shared_memory_bytes == 0
    assert sized.memory_bytes >= gemma_gguf.stat().st_size + sized.compute_buffer_bytes


def test_bigger_batch_means_more_memory(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    small = parse_spec(_spec_for(gemma_gguf, engine={"maxBatchSize": 4, "minBatchSize": 1}))
    large = parse_spec(_spec_for(gemma_gguf, engine={"maxBatchSize": 32}))
    shape = memory.read_gguf_shape(gemma_gguf)
    sized_small = size_of(small, settings, shape)
    sized_large = size_of(large, settings, shape)
    assert sized_large.kv_cache_bytes == 8 * sized_small.kv_cache_bytes
    assert sized_small.memory_bytes < sized_large.memory_bytes


def test_missing_header_falls_back_to_a_stated_estimate(tmp_path: Path) -> None:
    settings = OperatorSettings()
    spec = parse_spec(manifest()["spec"])  # hostPath not present on this machine
    assert sizing.find_gguf_shape(spec, settings) is None
    sized = size_of(spec, settings, None)
    assert sized.source == "estimate"
    assert sized.compute_buffer_bytes >= 512 * MIB


def test_threads_follow_the_cpu_limit() -> None:
    settings = OperatorSettings(default_cpu="1")
    assert size_of(parse_spec(manifest()["spec"]), settings, None).threads == 1
    limited = manifest(resources={"limits": {"cpu": "2500m", "memory": "2Gi"}})
    assert size_of(parse_spec(limited["spec"]), settings, None).threads == 2
    pinned = manifest(engine={"threads": 3})
    assert size_of(parse_spec(pinned["spec"]), settings, None).threads == 3


def test_startup_probe_allows_a_slow_load() -> None:
    settings = OperatorSettings(min_load_bandwidth_mib_s=10, startup_base_seconds=30)
    big = manifest(
        model={
            "name": "big",
            "source": {"hostPath": {"path": "/m"}},
            "files": [{"path": "m.gguf", "sha256": "0" * 64, "sizeBytes": 4000 * MIB}],
        }
    )
    sized = size_of(parse_spec(big["spec"]), settings, None)
    allowed = sized.startup_period_seconds * sized.startup_failure_threshold
    assert allowed >= 30 + 400  # 4000 MiB at 10 MiB/s


def test_quantities_canonical_like_the_api_server() -> None:
    assert quantity.format_bytes(1024 * MIB) == "1Gi"
    assert quantity.format_bytes(1536 * MIB) == "1536Mi"
    assert quantity.same("1Gi", "1024Mi") and quantity.same("1000m", "1")
    assert not quantity.same("1Gi", "1G")
    assert quantity.format_cpu(quantity.parse("2500m")) == "2500m"
    assert quantity.format_cpu(quantity.parse("2")) == "2"


def test_offloaded_layers_leave_the_host_memory(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    shape = memory.read_gguf_shape(gemma_gguf)
    gpu = {"accelerator": {"kind": "nvidia-gpu"}, "prewarm": {"enabled": False}}
    cpu = size_of(parse_spec(_spec_for(gemma_gguf, prewarm={"enabled": False})), settings, shape)
    full = size_of(parse_spec(_spec_for(gemma_gguf, **gpu)), settings, shape)
    # Every layer on the device: weights, KV cache and compute graph leave the host figure,
    # which keeps the logits (a row per sequence and per draft row) and the runtime's overhead.
    assert full.gpu_layers == ALL_LAYERS
    assert full.kv_cache_bytes == 0 and full.device_kv_cache_bytes == cpu.kv_cache_bytes
    assert full.device_weights_bytes == gemma_gguf.stat().st_size
    logits = shape.vocab * (16 + SpeculationConfig().draft_rows()) * 4
    assert full.compute_buffer_bytes == logits
    assert full.memory_bytes < cpu.memory_bytes - cpu.kv_cache_bytes
    assert full.memory_bytes >= logits + full.overhead_bytes
    figures = full.as_dict()
    assert figures["device_memory_bytes"] == full.device_memory_bytes > cpu.kv_cache_bytes
    assert figures["deviceMemory"].endswith("Mi")
    # Half of the 18 layers: half the KV cells on each side, the graph buffer on both.
    half = size_of(
        parse_spec(_spec_for(gemma_gguf, **gpu, engine={"gpuLayers": 9})), settings, shape
    )
    assert half.kv_cache_bytes == half.device_kv_cache_bytes == cpu.kv_cache_bytes // 2
    assert half.compute_buffer_bytes == cpu.compute_buffer_bytes
    assert full.memory_bytes < half.memory_bytes < cpu.memory_bytes


def test_prewarm_volume_still_holds_every_weight_on_a_gpu(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    spec = parse_spec(_spec_for(gemma_gguf, accelerator={"kind": "nvidia-gpu"}))
    sized = size_of(spec, settings, memory.read_gguf_shape(gemma_gguf))
    assert sized.kv_cache_bytes == 0
    assert sized.memory_bytes >= sized.shared_memory_bytes >= gemma_gguf.stat().st_size


def test_cpu_and_zero_layers_keep_their_figures(gemma_gguf: Path) -> None:
    settings = OperatorSettings()
    shape = memory.read_gguf_shape(gemma_gguf)
    cpu = size_of(parse_spec(_spec_for(gemma_gguf)), settings, shape)
    zero = size_of(
        parse_spec(
            _spec_for(gemma_gguf, accelerator={"kind": "nvidia-gpu"}, engine={"gpuLayers": 0})
        ),
        settings,
        shape,
    )
    assert zero.memory_bytes == cpu.memory_bytes and zero.device_memory_bytes == 0
    # No device keys at all: a CPU replica's sizing.yaml (and config hash) is what it was.
    assert not [k for k in cpu.as_dict() if "device" in k.lower() or k == "gpu_layers"]


def test_without_a_header_the_gpu_estimate_is_an_upper_bound_on_both_sides() -> None:
    settings = OperatorSettings()
    gpu = parse_spec(
        manifest(accelerator={"kind": "nvidia-gpu"}, prewarm={"enabled": False})["spec"]
    )
    partial = parse_spec(
        manifest(
            accelerator={"kind": "nvidia-gpu"},
            prewarm={"enabled": False},
            engine={"gpuLayers": 10},
        )["spec"]
    )
    full, some = size_of(gpu, settings, None), size_of(partial, settings, None)
    assert full.kv_cache_bytes == 0 and full.device_kv_cache_bytes > 0
    # Unknown depth: 10 layers may be all of them or a few, so each side counts everything.
    assert some.kv_cache_bytes == some.device_kv_cache_bytes == full.device_kv_cache_bytes


def test_an_embedding_deployment_is_sized_for_every_token_as_an_output(gemma_gguf: Path) -> None:
    # The embedding engine holds one pool of contextLength cells (not one per sequence), and
    # llama.cpp makes every token of a call an output: Gemma's 262k-row output layer sized for
    # contextLength rows, in the output buffer and the graph (engines/embedding, memory.py).
    settings = OperatorSettings()
    shape = memory.read_gguf_shape(gemma_gguf)
    spec = _spec_for(gemma_gguf)
    spec["model"].update(task="embed", pooling="mean")
    embed = parse_spec(spec)
    sized = size_of(embed, settings, shape)
    assert sized.kv_cache_bytes == 18 * 2048 * 1 * (256 + 256) * 2  # one pool of 2048 cells
    every_row = 2 * shape.vocab * 2048 * 4
    assert every_row <= sized.compute_buffer_bytes <= 1.1 * every_row
    generate = size_of(parse_spec(_spec_for(gemma_gguf)), settings, shape)
    assert sized.memory_bytes > generate.memory_bytes + 3 * 2**30  # ~4 GiB more at 2048


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"deterministic": True},
        {"contextLength": 512, "maxBatchSize": 4},
        # The previous release's flag: the runtime's engine honours it (separate KV streams),
        # so the operator must size for it too, not for what `deterministic` alone implies.
        {"args": {"exactBatching": "true"}},
    ],
)
def test_the_pod_is_sized_for_what_the_runtime_checks(
    gemma_gguf: Path, tmp_path: Path, engine: dict[str, Any]
) -> None:
    """The operator's figures and the runtime's preflight come from the one config the
    ConfigMap carries, so they cannot disagree about the engine's memory."""
    settings = OperatorSettings()
    spec = parse_spec(_spec_for(gemma_gguf, engine=engine))
    owner = render.Owner(name="demo", namespace="ns", uid="u-1")
    (cm,) = [m for m in rendered(owner, spec, settings, memory.read_gguf_shape(gemma_gguf))
             if m["kind"] == "ConfigMap"]  # fmt: skip
    config = RuntimeConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    figures = yaml.safe_load(cm["data"]["sizing.yaml"])
    need = preflight(config, gemma_gguf, tmp_path)  # no memory.max here: no limit to check
    assert need is not None
    assert (need.kv_cache, need.compute_buffer) == (
        figures["kv_cache_bytes"],
        figures["compute_buffer_bytes"],
    )
