"""LoRA adapters hot-plugged into a running runtime (issue 47): the runtime reads
`engine.adapters` again from its mounted config file (`server.adapters.reload_adapters`), so an
adapter added to the file is served under its name, and one removed from it answers 404, with
no restart of the base: the same engine object, the same start time, the same decode thread.
A wrong-checksum or wrong-base adapter added live is refused with its reason, the base serving
on; a missing file is refused until it appears.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.reasons import ADAPTER_REFUSED, parse_adapters_condition
from ember_runtime.contract.wire import dump_yaml
from ember_runtime.engines.llamacpp import LlamaCppEngine
from ember_runtime.server import adapters as server_adapters
from ember_runtime.server.app import create_app

from tests.runtime.conftest import LiveServer, make_config, start_live
from tests.support.lora import write_lora
from tests.support.model import sha256_file
from tests.support.waiting import wait_for

BASE = "gemma-3-270m"
PROMPT = "The capital of France is"
TOKENS = 16


@pytest.fixture(scope="module")
def loras(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hot-lora")
    return {
        "good": write_lora(model_path, tmp / "good.gguf", seed=1),
        "other-base": write_lora(model_path, tmp / "llama.gguf", seed=3, architecture="llama"),
    }


def _entry(name: str, path: Path, sha256: str | None = None) -> dict[str, Any]:
    return {"name": name, "path": str(path), "sha256": sha256 or sha256_file(path)}


class Conditions:
    """Where the runtime's pod conditions would go: kept, the newest last."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []

    async def write(self, condition: dict[str, Any]) -> None:
        self.written.append(condition)


class Hot:
    """A live runtime, the config file it reloads, and its adapters condition."""

    def __init__(
        self, live: LiveServer, path: Path, config: dict[str, Any], pod: Conditions
    ) -> None:
        self.live, self.path, self.config, self.pod = live, path, config, pod

    def write(self, entries: list[dict[str, Any]]) -> None:
        self.config["engine"]["adapters"] = entries
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(dump_yaml(self.config, sort_keys=False))
        tmp.replace(self.path)  # as the kubelet swaps a ConfigMap's files: atomically

    def engine(self) -> LlamaCppEngine:
        return cast(LlamaCppEngine, self.live.state.engine)

    def wait_served(self, served: list[str], refused: Collection[str] = ()) -> None:
        info = self.engine().info

        def settled() -> bool:
            return list(info.adapters) == served and set(info.refused_adapters) == set(refused)

        wait_for(f"adapters {served}, refused {refused}", settled, 60, 0.05)


@pytest.fixture(scope="module")
def hot(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hot]:
    tmp = tmp_path_factory.mktemp("hot")
    data = make_config(tmp).model_dump(mode="json", by_alias=True)
    path = tmp / "config.yaml"
    path.write_text(dump_yaml(data, sort_keys=False))
    config = RuntimeConfig.model_validate(data)
    patch = pytest.MonkeyPatch()
    patch.setattr(server_adapters, "RELOAD_SECONDS", 0.1)
    pod = Conditions()
    reporter = server_adapters.adapter_reporter(pod, min_interval=0.0)
    app = create_app(config, model_path=model_path, config_path=path, adapters_reporter=reporter)
    live = start_live(app)
    yield Hot(live, path, data, pod)
    live.stop()
    patch.undo()


async def _complete(url: str, model: str, tokens: int = TOKENS) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    if tokens > TOKENS:
        body["ignore_eos"] = True  # a long request: it runs its whole length
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await client.post("/v1/completions", json=body)


async def _text(url: str, model: str) -> str:
    reply = await _complete(url, model)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    return cast(str, reply.json()["choices"][0]["text"])


async def _ids(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]


async def _admin(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return cast(dict[str, Any], (await client.get("/admin/state")).json())


def _decode_thread(engine: LlamaCppEngine) -> threading.Thread:
    """This engine's own decode thread: other tests' engines may still be alive in the
    session, each with an `ember-decode` thread of its own."""
    thread = engine._thread
    assert thread is not None
    assert thread.is_alive()
    return thread


async def test_add_then_remove_an_adapter_without_a_restart(
    hot: Hot, loras: dict[str, Path], tmp_path: Path
) -> None:
    url, state = hot.live.url, hot.live.state
    engine, started = hot.engine(), state.started
    thread = _decode_thread(engine)
    base = await _text(url, BASE)
    assert await _ids(url) == [BASE]

    # Added: a good adapter, one of another base, one whose sha256 is wrong, one not there yet.
    late = tmp_path / "late.gguf"
    hot.write(
        [
            _entry("good", loras["good"]),
            _entry("other-base", loras["other-base"]),
            _entry("bad-digest", loras["good"], "0" * 64),
            {"name": "late", "path": str(late), "sha256": sha256_file(loras["good"])},
        ]
    )
    hot.wait_served(["good"], {"other-base", "bad-digest", "late"})
    assert await _ids(url) == [BASE, "good"]
    adapted = await _text(url, "good")
    assert adapted.strip()
    assert adapted != base
    admin = await _admin(url)
    assert admin["adapters"] == ["good"]
    refused = admin["refusedAdapters"]
    assert "architecture 'llama'" in refused["other-base"]
    assert refused["bad-digest"].startswith("sha256 mismatch")
    assert refused["late"].startswith("adapter file not found")
    # The pod's condition says which and why (what the operator folds into AdaptersReady).
    await asyncio.to_thread(
        wait_for,
        "the adapters condition",
        lambda: hot.pod.written and hot.pod.written[-1]["reason"] == ADAPTER_REFUSED,
        30,
        0.02,
    )
    condition = hot.pod.written[-1]
    assert condition["status"] == "False"
    report = parse_adapters_condition([condition])
    assert report is not None
    assert report.served == ("good",)
    assert [name for name, _ in report.refused] == ["bad-digest", "late", "other-base"]
    assert "sha256 mismatch" in condition["message"]
    rejected = await _complete(url, "other-base")
    assert rejected.status_code == 404
    assert "architecture 'llama'" in rejected.json()["error"]["message"]
    assert await _text(url, BASE) == base  # the base serves on, unchanged

    # The missing file arrives (as the node agent's view gets its link): served next tick.
    shutil.copyfile(loras["good"], late)
    hot.wait_served(["good", "late"], {"other-base", "bad-digest"})
    assert await _text(url, "late") == adapted  # the same bytes: the same greedy text

    # Removed while a long request runs on it: it finishes; new requests get 404.
    running = asyncio.create_task(_complete(url, "good", tokens=200))
    await asyncio.to_thread(
        wait_for, "the long request to run", lambda: engine.state().active == 1, 60, 0.01
    )
    hot.write([_entry("late", late)])
    await asyncio.to_thread(hot.wait_served, ["late"])
    gone = await _complete(url, "good")
    assert gone.status_code == 404
    assert "removed" in gone.json()["error"]["message"]
    assert await _ids(url) == [BASE, "late"]
    assert engine.retiring_adapters == 1  # held for the running request
    finished = await running
    assert finished.status_code == 200
    choice = finished.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"].startswith(adapted)  # decoded with "good" to the end
    await asyncio.to_thread(
        wait_for, "the removed adapter freed", lambda: engine.retiring_adapters == 0, 30, 0.02
    )
    assert await _text(url, "late") == adapted
    assert await _text(url, BASE) == base
    await asyncio.to_thread(
        wait_for,
        "the all-clear",
        lambda: hot.pod.written[-1]["status"] == "True",
        30,
        0.02,
    )
    assert parse_adapters_condition(hot.pod.written[-1:]) is not None

    # No restart anywhere.
    assert hot.live.state.engine is engine
    assert hot.live.state.started == started
    assert _decode_thread(engine) is thread
    assert hot.live.thread.is_alive()
