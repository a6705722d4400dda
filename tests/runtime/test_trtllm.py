"""The TensorRT-LLM adapter's real code against a fake `tensorrt_llm` (no GPU or package here).

`trtllm_fake/` holds a minimal `tensorrt_llm` + `pynvml` with the public surface and semantics of
the real ones (see its README); it goes on `sys.path` only inside these tests. What this cannot
show: real kernels, real detokenization, real in-flight batching on a GPU.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.engines.base import (
    ChatMessage,
    Delta,
    EngineStoppingError,
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    SamplingParams,
)
from ember_runtime.engines.trtllm import TrtLlmEngine
from ember_runtime.server.app import create_app

FAKE = Path(__file__).resolve().parent / "trtllm_fake"
_FAKE_MODULES = ("tensorrt_llm", "tensorrt_llm._tensorrt_engine", "pynvml")


def _forget_fake() -> None:
    for name in _FAKE_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake `tensorrt_llm` importable, one GPU visible through the fake `pynvml`."""
    _forget_fake()
    monkeypatch.syspath_prepend(str(FAKE))
    import pynvml  # the fake one, from the path just added
    import tensorrt_llm

    assert Path(tensorrt_llm.__file__).is_relative_to(FAKE)  # never a real install by accident
    monkeypatch.setattr(pynvml, "device_count", 1)
    tensorrt_llm.instances.clear()
    yield tensorrt_llm
    _forget_fake()


def make_engine(engine_dir: Path, capacity: int = 4, max_queue: int = 8) -> TrtLlmEngine:
    return TrtLlmEngine(engine_dir, context_length=256, capacity=capacity, max_queue=max_queue)


async def drain(stream: Any) -> list[Delta]:
    return [delta async for delta in stream]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


# --- start: the clear errors -----------------------------------------------------------------


async def test_start_without_the_package_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import -> ImportError
    with pytest.raises(EngineUnavailableError, match=r"tensorrt_llm package and an NVIDIA GPU"):
        await make_engine(tmp_path).start()


@pytest.mark.parametrize("devices", [0, -1])  # no GPU; no driver (nvmlInit fails)
async def test_start_without_a_gpu_says_so(
    fake: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, devices: int
) -> None:
    monkeypatch.setattr(sys.modules["pynvml"], "device_count", devices)
    with pytest.raises(EngineUnavailableError, match="found no NVIDIA GPU"):
        await make_engine(tmp_path).start()
    assert fake.instances == []  # it failed before loading anything


async def test_start_without_the_engine_dir_names_it(fake: ModuleType, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(EngineUnavailableError, match=str(missing)):
        await make_engine(missing).start()


async def test_checkpoint_vs_prebuilt_engine_picks_the_llm_class(
    fake: ModuleType, tmp_path: Path
) -> None:
    await make_engine(tmp_path).start()
    (tmp_path / "built").mkdir()
    (tmp_path / "built" / "rank0.engine").write_bytes(b"")
    built = make_engine(tmp_path / "built")
    await built.start()
    assert [(llm.backend, llm.model) for llm in fake.instances] == [
        ("pytorch", tmp_path),
        ("tensorrt", tmp_path / "built"),
    ]
    await built.stop()
    assert fake.instances[1].shut_down


# --- requests ------------------------------------------------------------------------------


async def test_greedy_stream_maps_params_text_and_token_counts(
    fake: ModuleType, tmp_path: Path
) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    prompt = engine.tokenize("abc", add_special=True)
    assert prompt == [1, 100, 101, 102]  # BOS + bytes, through the real tokenizer call
    deltas = await drain(engine.submit(prompt, SamplingParams(max_tokens=7)))
    assert text_of(deltas) == "abcabca"  # the fake model echoes the prompt
    assert sum(d.n_tokens for d in deltas) == 7
    assert [d.finish_reason for d in deltas] == [None] * 6 + [FinishReason.LENGTH]
    sent = fake.instances[0].requests[0].sampling_params
    assert sent.max_tokens == 7
    assert sent._greedy_decoding  # TensorRT-LLM itself must see a greedy request
    assert sent.temperature is None
    assert sent.stop is None


async def test_sampling_params_and_seeds(fake: ModuleType, tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    sampled = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9)
    for params in (sampled, sampled, SamplingParams(max_tokens=2, temperature=0.7, seed=42)):
        await drain(engine.submit([1, 100], params))
    first, second, seeded = (r.sampling_params for r in fake.instances[0].requests)
    assert not first._greedy_decoding
    assert (first.temperature, first.top_p, first.top_k) == (0.7, 0.9, None)
    # Without a seed every request draws its own (the C++ default would be 0 for all).
    assert isinstance(first.seed, int) and first.seed != second.seed
    assert (seeded.seed, seeded.top_p) == (42, 1.0)
    assert not seeded._greedy_decoding


async def test_stop_string_finishes_with_stop_and_is_not_emitted(
    fake: ModuleType, tmp_path: Path
) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    prompt = engine.tokenize("one two ", add_special=False)
    deltas = await drain(engine.submit(prompt, SamplingParams(max_tokens=30, stop=("two",))))
    # "two" is three tokens here: TensorRT-LLM's own token-level stop words would already have
    # streamed "tw" before matching, so the adapter matches the text itself and aborts.
    assert text_of(deltas) == "one "
    assert deltas[-1].finish_reason is FinishReason.STOP
    request = fake.instances[0].requests[0]
    assert request.sampling_params.stop is None
    assert request.abort_calls == 1


async def test_cancel_aborts_and_ends_cancelled(fake: ModuleType, tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    stream = engine.submit([1, 100, 101], SamplingParams(max_tokens=200))
    seen: list[Delta] = []
    async for delta in stream:
        seen.append(delta)
        if len(seen) == 3:
            stream.cancel()
            stream.cancel()  # idempotent: one abort
    request = fake.instances[0].requests[0]
    assert request.abort_calls == 1
    assert seen[-1].finish_reason is FinishReason.CANCELLED
    assert engine.state().active == 0  # the slot came back


async def test_rejected_request_is_an_error_delta_not_a_crash(
    fake: ModuleType, tmp_path: Path
) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    deltas = await drain(engine.submit([1, 100], SamplingParams(max_tokens=1000)))
    assert len(deltas) == 1
    assert deltas[0].finish_reason is FinishReason.ERROR
    assert deltas[0].error is not None and "max_seq_len" in deltas[0].error
    await engine.stop()
    with pytest.raises(EngineStoppingError, match="shutting down"):
        engine.submit([1, 100], SamplingParams(max_tokens=1))


async def test_admin_batch_limit_gates_admission(fake: ModuleType, tmp_path: Path) -> None:
    engine = make_engine(tmp_path, capacity=4, max_queue=1)
    await engine.start()
    engine.set_max_batch_size(1)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        engine.set_max_batch_size(5)
    first = aiter(engine.submit([1, 100], SamplingParams(max_tokens=40)))
    await anext(first)  # admitted and generating
    second = asyncio.create_task(drain(engine.submit([1, 101], SamplingParams(max_tokens=2))))
    await asyncio.sleep(0.01)
    state = engine.state()
    assert (state.max_batch_size, state.active, state.queued) == (1, 1, 1)
    assert len(fake.instances[0].requests) == 1  # the second one waits on our side
    with pytest.raises(QueueFullError):
        engine.submit([1, 102], SamplingParams(max_tokens=2))
    assert len([d async for d in first]) == 39
    await second
    # The second request only reached TensorRT-LLM after the first one left the batch.
    requests = fake.instances[0].requests
    assert [r.prompt_token_ids for r in requests] == [[1, 100], [1, 101]]
    assert engine.state().active == 0


async def test_chat_template_comes_from_the_tokenizer(fake: ModuleType, tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    await engine.start()
    rendered = engine.render_chat([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    assert rendered == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


async def test_served_over_http_with_the_tensorrt_llm_engine_kind(
    fake: ModuleType, tmp_path: Path
) -> None:
    config = RuntimeConfig.model_validate(
        {
            "modelName": "tiny-trt",
            "format": "trtllm-engine",
            "modelDir": str(tmp_path),
            "accelerator": "nvidia-gpu",
            "engine": {"kind": "tensorrt-llm", "maxBatchSize": 2, "contextLength": 256},
            "sensors": {"sysfsRoot": str(tmp_path / "no-sysfs")},
        }
    )
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ember") as client:
            body = {"prompt": "xyz", "max_tokens": 5, "temperature": 0}
            reply = (await client.post("/v1/completions", json=body)).json()
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            chat_reply = (await client.post("/v1/chat/completions", json=chat)).json()
            # what this adapter does not implement is refused, never ignored
            scored = await client.post("/v1/completions", json={**body, "logprobs": 1})
            json_mode = {**chat, "response_format": {"type": "json_object"}}
            constrained = await client.post("/v1/chat/completions", json=json_mode)
    assert scored.status_code == 400 and scored.json()["error"]["param"] == "logprobs"
    assert constrained.status_code == 400
    assert constrained.json()["error"]["param"] == "response_format"
    assert reply["choices"][0]["text"] == "xyzxy"
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert chat_reply["choices"][0]["message"]["content"] == "<|u"
