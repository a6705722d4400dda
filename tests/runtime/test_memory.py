"""The engine's memory rule (ember_runtime.memory) and the runtime's refusal to start when its
cgroup limit is too small. No model is loaded: the check runs before that."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ember_runtime import memory
from ember_runtime.contract import reasons
from ember_runtime.contract.config import ALL_LAYERS, RuntimeConfig, offloaded_layers
from ember_runtime.server.preflight import preflight

from tests.support.server_exit import refused_start

MIB = 2**20


def fake_cgroup(root: Path, limit: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    return root


def test_cgroup_limits(tmp_path: Path) -> None:
    assert memory.cgroup_memory_limit(fake_cgroup(tmp_path / "a", "max")) is None
    assert memory.cgroup_memory_limit(fake_cgroup(tmp_path / "b", "1073741824")) == 1 << 30
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert memory.cgroup_memory_limit(tmp_path / "v1") is None
    (v1 / "memory.limit_in_bytes").write_text("536870912\n")
    assert memory.cgroup_memory_limit(tmp_path / "v1") == 512 * MIB
    assert memory.cgroup_memory_limit(tmp_path / "none") is None


def test_kv_cache_grows_with_sequences_and_context(model_path: Path) -> None:
    shape = memory.read_gguf_shape(model_path)
    one = memory.engine_memory(shape, context=512, sequences=1)
    many = memory.engine_memory(shape, context=512, sequences=16)
    longer = memory.engine_memory(shape, context=2048, sequences=16)
    assert many.kv_cache == 16 * one.kv_cache
    assert longer.kv_cache == 4 * many.kv_cache
    assert many.compute_buffer > one.compute_buffer  # 16 decode rows more per micro-batch


def test_check_limit_says_why_in_one_line(model_path: Path) -> None:
    need = memory.engine_memory(memory.read_gguf_shape(model_path), context=2048, sequences=16)
    memory.check_limit(need, 300 * MIB, None)  # unlimited
    memory.check_limit(need, 300 * MIB, need.total + 300 * MIB)  # exactly enough
    with pytest.raises(memory.MemoryLimitError) as info:
        memory.check_limit(need, 300 * MIB, need.total)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("memory: needs ")
    assert "KV cache 576" in message and "maxBatchSize" in message


def test_prewarmed_weights_are_not_charged_to_the_container(
    model_path: Path, tmp_path: Path
) -> None:
    config = RuntimeConfig(model_name="m", model_dir=str(model_path.parent))
    shape, drafts = memory.read_gguf_shape(model_path), config.engine.draft_rows()
    need = memory.engine_memory(shape, context=2048, sequences=16, draft_rows=drafts)
    just_enough = fake_cgroup(tmp_path / "cg", str(need.total))
    with pytest.raises(memory.MemoryLimitError):  # the mapped file's page cache counts
        preflight(config, model_path, just_enough)
    prewarmed = config.model_copy(update={"prewarm_dir": str(model_path.parent)})
    assert preflight(prewarmed, model_path, just_enough) == need


def test_runtime_refuses_to_start_under_a_small_limit(model_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "modelName": "gemma",
                "modelDir": str(model_path.parent),
                "engine": {"contextLength": 2048, "maxBatchSize": 16},
                "terminationLog": str(log),
            }
        )
    )
    env = {**os.environ, "EMBER_CGROUP_ROOT": str(fake_cgroup(tmp_path / "cg", str(256 * MIB)))}
    reason, detail, stderr = refused_start(config, log, env)
    assert "\n" not in log.read_text().rstrip("\n")
    assert reason == reasons.ENGINE_MEMORY_OVER_LIMIT and detail.startswith("memory: needs ")
    assert "container limit is 256 MiB" in detail
    assert "llama.cpp engine ready" not in stderr  # refused before loading the model


def test_offload_splits_by_layer() -> None:
    assert memory.Offload.of(0, 18) == memory.CPU_ONLY
    assert memory.Offload.of(ALL_LAYERS, 18) == memory.Offload(host=0.0, device=1.0)
    assert memory.Offload.of(9, 18).split(1000) == (500, 500)
    assert memory.Offload.of(ALL_LAYERS, None) == memory.Offload(host=0.0, device=1.0)
    assert memory.Offload.of(4, None) == memory.Offload(host=1.0, device=1.0)
    assert offloaded_layers(None, "nvidia-gpu") == ALL_LAYERS
    assert offloaded_layers(None, "cpu") == 0
    assert offloaded_layers(5, "cpu") == 5


def test_offloaded_kv_cache_is_not_charged_to_the_container(
    model_path: Path, tmp_path: Path
) -> None:
    """A GPU replica sized for its host side only starts; the same limit refuses a CPU one."""
    shape = memory.read_gguf_shape(model_path)
    config = RuntimeConfig(model_name="m", model_dir=str(model_path.parent))
    drafts = config.engine.draft_rows()  # speculation's rows: their logits stay on the host
    cpu_need = memory.engine_memory(shape, context=2048, sequences=16, draft_rows=drafts)
    gpu_need = memory.engine_memory(
        shape,
        context=2048,
        sequences=16,
        offload=memory.Offload(host=0.0, device=1.0),
        draft_rows=drafts,
    )
    assert gpu_need.device_kv_cache == cpu_need.kv_cache and gpu_need.kv_cache == 0
    assert gpu_need.total < cpu_need.total
    limit = fake_cgroup(tmp_path / "cg", str(gpu_need.total))
    with pytest.raises(memory.MemoryLimitError):
        preflight(config, model_path, limit)
    on_gpu = config.model_copy(update={"accelerator": "nvidia-gpu"})
    assert preflight(on_gpu, model_path, limit) == gpu_need


def test_a_draft_model_adds_its_cells_and_batch_to_the_check(model_path: Path) -> None:
    """engine.draftModel: its own KV cells for every sequence and its batch's buffers, in the
    figure the runtime checks (and the operator sizes with); the served model's part unchanged."""
    files = [
        {"path": model_path.name, "sha256": "0" * 64, "sizeBytes": 1},
        {"path": "draft.gguf", "sha256": "0" * 64, "sizeBytes": 1},
    ]
    fields = {"model_name": "m", "model_dir": str(model_path.parent), "files": files}
    plain = RuntimeConfig.model_validate(fields)
    speculation = {"speculation": {"draftModel": "draft.gguf"}}
    drafted = RuntimeConfig.model_validate({**fields, "engine": speculation})
    shape = memory.read_gguf_shape(model_path)
    alone = memory.replica_memory(plain, shape)
    assert memory.replica_memory(plain, shape, draft=shape) == alone, "no draft configured"
    both = memory.replica_memory(drafted, shape, draft=shape)
    own = memory.engine_memory(
        shape,
        context=2048,
        sequences=plain.engine.max_batch_size,
        step_tokens=512 - plain.engine.max_batch_size,
        overhead=0,
        unified=True,
    )
    assert both.kv_cache == alone.kv_cache + own.kv_cache
    assert both.compute_buffer == alone.compute_buffer + own.compute_buffer
    assert both.overhead == alone.overhead
