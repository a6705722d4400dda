"""`spec.sampling`: a deployment's defaults for the sampling fields a request leaves out, on the
real server with the real model. The server here defaults top_k to 1 (keep only the most likely
token), so a request that sends nothing is greedy whatever its seed, and a request that sends
top_k 0 (the server's own default value) samples: what the client sent wins, even at a value
equal to the built-in default."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.config import RuntimeConfig, SamplingDefaults
from ember_runtime.server.app import create_app
from ember_runtime.server.routes import with_defaults
from ember_runtime.server.schemas import CompletionRequest
from pydantic import ValidationError

from tests.runtime.conftest import LiveServer, make_config, start_live

PROMPT = {"prompt": "Once upon a time", "max_tokens": 12}
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12}
SEEDS = range(1, 5)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[LiveServer]:
    base = make_config(tmp_path_factory.mktemp("sampling-defaults"))
    config = base.model_copy(update={"sampling": SamplingDefaults(top_k=1)})
    server = start_live(create_app(config, model_path=model_path))
    yield server
    server.stop()


def _text(http: httpx.Client, route: str, body: dict[str, Any]) -> str:
    resp = http.post(route, json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def test_left_out_fields_take_the_deployment_default(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for route, body in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
            greedy = _text(http, route, {**body, "temperature": 0})
            # temperature is OpenAI's 1 here; top_k 1 leaves one candidate per step
            assert {_text(http, route, {**body, "seed": s}) for s in SEEDS} == {greedy}


def test_a_field_the_client_sends_wins(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url, timeout=120) as http:
        greedy = _text(http, "/v1/completions", {**PROMPT, "temperature": 0})
        sampled = {_text(http, "/v1/completions", {**PROMPT, "top_k": 0, "seed": s}) for s in SEEDS}
    assert sampled != {greedy}, "top_k 0 sent by the client must turn the default filter off"


def test_defaults_fill_only_what_the_body_left_out() -> None:
    defaults = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05).given()
    sent = CompletionRequest.model_validate({"prompt": "x", "temperature": 1.0, "min_p": 0.0})
    filled = with_defaults(sent, defaults)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p) == (1.0, 0.95, 40, 0.0)
    assert with_defaults(sent, {}) is sent


def test_the_config_refuses_defaults_an_engine_or_task_cannot_apply(tmp_path: Path) -> None:
    data = make_config(tmp_path).model_dump(by_alias=True)
    trt = {**data, "format": "trtllm-engine", "engine": {"kind": "tensorrt-llm"}}
    with pytest.raises(ValidationError, match="sampling top_k, min_p requires the llamacpp"):
        RuntimeConfig.model_validate({**trt, "sampling": {"topK": 40, "minP": 0.1}})
    RuntimeConfig.model_validate({**trt, "sampling": {"temperature": 0.7, "topP": 0.9}})
    with pytest.raises(ValidationError, match="sampling defaults require task generate"):
        RuntimeConfig.model_validate({**data, "task": "embed", "sampling": {"temperature": 0.7}})
    with pytest.raises(ValidationError, match="topP"):
        RuntimeConfig.model_validate({**data, "sampling": {"topP": 0}})
