"""LoRA adapters on the shared base (the runtime slice of issue 47).

A live runtime serves the test model with five adapters written by `tests/support/lora.py`: two
good ones (different seeds), one for another architecture, one whose tensor shapes do not fit
(llama.cpp's own check refuses it), and one whose configured sha256 is wrong. The engine runs in
deterministic mode, so a request's greedy output is the same alone or beside others; and the
reference is llama.cpp's own `llama-server --lora` on the same files.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.engines.base import SamplingParams
from ember_runtime.engines.llama_native import LlamaContext
from ember_runtime.engines.scheduler import Call, Chunk, split_by_adapter
from ember_runtime.engines.slots import Sequence, Slots
from ember_runtime.server.app import create_app
from pydantic import ValidationError

from tests.runtime.conftest import LiveServer, make_config, start_live
from tests.runtime.test_chat_parity import (
    CLEAR_MARGIN,
    CONVERSATIONS,
    _chat,
    _parting,
    reference_llama_server,
)
from tests.support.lora import write_lora
from tests.support.model import sha256_file

BASE = "gemma-3-270m"
GOOD = ("style-a", "style-b")
MESSAGES = CONVERSATIONS[0]
TOKENS = 24


@pytest.fixture(scope="module")
def adapter_files(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora")
    return {
        "style-a": write_lora(model_path, tmp / "a.gguf", seed=1),
        "style-b": write_lora(model_path, tmp / "b.gguf", seed=2),
        "other-base": write_lora(model_path, tmp / "llama.gguf", seed=3, architecture="llama"),
        "bad-shapes": write_lora(model_path, tmp / "shapes.gguf", seed=4, transpose=True),
        "bad-digest": write_lora(model_path, tmp / "digest.gguf", seed=5),
    }


def _config(tmp: Path, files: dict[str, Path]) -> RuntimeConfig:
    data = make_config(tmp).model_dump(mode="json", by_alias=True)
    data["engine"]["deterministic"] = True
    data["engine"]["adapters"] = [
        {
            "name": name,
            "path": str(path),
            "sha256": "0" * 64 if name == "bad-digest" else sha256_file(path),
        }
        for name, path in files.items()
    ]
    return RuntimeConfig.model_validate(data)


@pytest.fixture(scope="module")
def lora_server(
    adapter_files: dict[str, Path], model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    config = _config(tmp_path_factory.mktemp("sysfs"), adapter_files)
    live = start_live(create_app(config, model_path=model_path))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def llama_lora(
    adapter_files: dict[str, Path], model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """llama-server with style-a applied to every request (`--lora`, scale 1), laid out as the
    deterministic engine runs: plain (not repacked) weights, one sequence."""
    log_dir = tmp_path_factory.mktemp("llama-server")
    lora = str(adapter_files[GOOD[0]])
    with reference_llama_server(model_path, log_dir, "--lora", lora) as url:
        yield url


async def _reply(url: str, model: str) -> str:
    data = await _chat(url, MESSAGES, max_tokens=TOKENS, model=model)
    assert data["model"] == model
    return cast(str, data["choices"][0]["message"]["content"])


async def test_adapter_output_matches_llama_server_lora(
    lora_server: LiveServer, llama_lora: str
) -> None:
    ours = await _reply(lora_server.url, GOOD[0])
    theirs = await _chat(llama_lora, MESSAGES, max_tokens=TOKENS, logprobs=True, top_logprobs=2)
    (choice,) = theirs["choices"]
    agreed, margin = _parting(ours.encode(), choice["logprobs"]["content"])
    # As in test_chat_parity: two programs may part only where llama-server itself hesitated.
    if margin is not None:
        assert margin < CLEAR_MARGIN, (agreed, margin, ours, choice["message"]["content"])
        return
    assert ours == choice["message"]["content"]


async def test_adapters_change_the_output(lora_server: LiveServer) -> None:
    base, a, b = [await _reply(lora_server.url, m) for m in (BASE, *GOOD)]
    assert len({base, a, b}) == 3, (base, a, b)
    assert all(text.strip() for text in (base, a, b))  # finite logits: real text, not nothing


async def test_refused_adapters_say_why_and_the_base_serves(lora_server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=lora_server.url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()
        state = (await client.get("/admin/state")).json()
        refused = await client.post(
            "/v1/completions", json={"model": "other-base", "prompt": "Hi", "max_tokens": 2}
        )
    assert [m["id"] for m in models["data"]] == [BASE, *GOOD]
    assert state["adapters"] == list(GOOD)
    reasons = state["refusedAdapters"]
    assert set(reasons) == {"other-base", "bad-shapes", "bad-digest"}
    assert "architecture 'llama'" in reasons["other-base"]
    assert "llama.cpp refused it" in reasons["bad-shapes"]
    assert reasons["bad-digest"].startswith("sha256 mismatch")
    assert refused.status_code == 404
    assert "architecture 'llama'" in refused.json()["error"]["message"]
    assert (await _reply(lora_server.url, BASE)).strip()


async def test_concurrent_adapters_match_their_lone_outputs(lora_server: LiveServer) -> None:
    names = (*GOOD, BASE)
    alone = [await _reply(lora_server.url, m) for m in names]
    steps = lora_server.state.engine.state().steps
    together = await asyncio.gather(*(_reply(lora_server.url, m) for m in names))
    assert list(together) == alone
    # They overlapped: three requests of TOKENS tokens each took fewer steps than one by one.
    assert lora_server.state.engine.state().steps - steps < 3 * TOKENS


# --- no model --------------------------------------------------------------------------------


class _Seq:
    def __init__(self, adapter: str | None, prompt_len: int = 4, prefilled: int = 0) -> None:
        self.adapter, self.prompt_len, self.prefilled = adapter, prompt_len, prefilled


def test_calls_are_split_per_adapter_keeping_order() -> None:
    a1, b1, base, a2 = _Seq("a", 4, 4), _Seq("b", 4, 4), _Seq(None, 4, 4), _Seq("a")
    call = Call(decodes=[a1, b1, base], chunks=[Chunk(a2, 0, 4)])
    calls = split_by_adapter([call], lambda s: s.adapter)
    assert [(c.decodes, [k.seq for k in c.chunks]) for c in calls] == [
        ([a1], [a2]),
        ([b1], []),
        ([base], []),
    ]


class _FakeNative:
    ctx = None

    def forget(self, sid: int, start: int = -1) -> bool:
        return True

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        pass


def _sequence(adapter: str | None, prompt: list[int]) -> Sequence:
    params = SamplingParams(max_tokens=1, adapter=adapter)
    return Sequence(cast(Any, None), prompt, params, cast(Any, None), None)


def test_prefix_cache_is_never_shared_across_adapters() -> None:
    slots = Slots(cast(LlamaContext, _FakeNative()), 1, prefix_cache=True, unified=True)
    prompt = list(range(10))
    first = _sequence("a", prompt)
    slots.admit(first)
    first.prefilled = len(prompt)
    live = _sequence("b", prompt)  # the prompt is computed under "a": nothing to share
    slots.release(first, 1)
    slots.admit(live)
    assert live.prefilled == 0
    live.prefilled = len(prompt)
    slots.release(live, 2)
    again = _sequence("b", prompt)  # the cache holds b's cells now
    slots.admit(again)
    assert again.prefilled == len(prompt) - 1


def test_adapter_names_are_checked(tmp_path: Path) -> None:
    entry = {"path": "a.gguf", "sha256": "0" * 64}
    base = {"modelName": BASE, "modelDir": str(tmp_path)}
    twice = [{"name": "x", **entry}, {"name": "x", **entry}]
    with pytest.raises(ValidationError, match="unique"):
        RuntimeConfig.model_validate({**base, "engine": {"adapters": twice}})
    with pytest.raises(ValidationError, match="modelName"):
        RuntimeConfig.model_validate({**base, "engine": {"adapters": [{"name": BASE, **entry}]}})
    config = RuntimeConfig.model_validate({**base, "engine": {"adapters": [twice[0]]}})
    assert config.engine.adapters[0].scale == 1.0
    assert config.adapter_file(config.engine.adapters[0]) == tmp_path / "a.gguf"
    assert "adapters" not in RuntimeConfig.model_validate(base).restart_relevant_yaml()
