"""Ember's runtime as the conformance cases meet it: the real engine on Gemma 3 270M, over
real HTTP, configured as tests/runtime's `server` (capacity 4, 512 tokens per sequence).

`ember` serves generation; `ember_embed` serves the same GGUF as an embedding model
(`task: embed`, mean pooling, as `llama-server --embeddings --pooling mean` in the bench).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.server.app import create_app

from tests.conformance.cases import Case
from tests.runtime.conftest import LiveServer, make_config, start_live
from tests.support.model import default_model_path

MODEL = "gemma-3-270m"  # make_config's modelName: the id /v1/models answers


def embed_config(tmp: Path) -> RuntimeConfig:
    """The test config with `task: embed`: a ValidationError on a runtime without embeddings."""
    data = make_config(tmp, maxQueue=16).model_dump(by_alias=True)
    return RuntimeConfig.model_validate({**data, "task": "embed", "pooling": "mean"})


@pytest.fixture(scope="session")
def ember(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = make_config(tmp_path_factory.mktemp("conformance"), maxQueue=16)
    live = start_live(create_app(config, model_path=default_model_path()))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def ember_embed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = embed_config(tmp_path_factory.mktemp("conformance-embed"))
    live = start_live(create_app(config, model_path=default_model_path()))
    yield live
    live.stop()


@pytest.fixture
def run_case(request: pytest.FixtureRequest) -> Callable[[Case], None]:
    """Runs one case on the Ember server it needs. Any exception fails it, `LengthLimit` too: a
    reply cut at max_tokens (finish_reason "length") is not a pass."""

    def run(case: Case) -> None:
        live: LiveServer = request.getfixturevalue("ember_embed" if case.embed else "ember")
        case.run(live.url, MODEL)

    return run
