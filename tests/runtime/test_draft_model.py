"""A draft model (`engine.draftModel`, engines/draft.py) on the real Gemma model.

- The vocabulary check (`ember_runtime.vocabulary`) finds each kind of difference from the
  GGUF headers: tokenizer, size, one token's text (the digest), begin and end tokens.
- With Gemma drafting for itself, nearly every draft token is kept and the greedy text is the
  text without speculation, token for token up to a near-tie (test_speculative_model.py says
  why), on prompts whose replies do not repeat them (where the lookup has nothing to draft).
- An engine refuses a draft model of another vocabulary before loading anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import pytest
from ember_runtime import vocabulary
from ember_runtime.contract.config import ModelFile, RuntimeConfig
from ember_runtime.engines.base import EngineUnavailableError
from ember_runtime.engines.draft import DraftModel, Want
from ember_runtime.engines.llama_native import Vocab
from ember_runtime.engines.llamacpp import LlamaCppEngine
from ember_runtime.engines.speculative import SpecSettings
from ember_runtime.server.app import create_app

from tests.runtime.conftest import make_config, start_live
from tests.runtime.test_speculative_model import (
    ROW_COST,
    TOKENS,
    WORKLOADS,
    Drafts,
    _metric,
    running,
    same_with_and_without_drafts,
)
from tests.support.vocab_gguf import OTHER_TOKENS, write_vocab_gguf


def test_the_vocabulary_check_finds_each_difference(tmp_path: Path, model_path: Path) -> None:
    assert vocabulary.difference(model_path, model_path) is None
    base = write_vocab_gguf(tmp_path / "base.gguf")
    assert vocabulary.difference(base, write_vocab_gguf(tmp_path / "same.gguf")) is None
    renamed = [*OTHER_TOKENS[:-1], "  "]  # the same size, one token's text differs
    cases = {
        "token list": write_vocab_gguf(tmp_path / "t.gguf", renamed),
        "vocabulary size": write_vocab_gguf(tmp_path / "s.gguf", OTHER_TOKENS[:-1]),
        "tokenizer": write_vocab_gguf(tmp_path / "k.gguf", tokenizer="gpt2"),
        "begin token": write_vocab_gguf(tmp_path / "b.gguf", bos=3),
        "end token": write_vocab_gguf(tmp_path / "e.gguf", eos=3),
    }
    for what, draft in cases.items():
        why = vocabulary.difference(base, draft)
        assert why is not None and f": {what} " in why, (what, why)
    assert "vocabulary size 10 against 262144" in str(vocabulary.difference(model_path, base))


async def test_a_draft_model_drafts_and_the_greedy_text_is_unchanged(model_path: Path) -> None:
    drafts = Drafts()
    settings = SpecSettings(row_cost=ROW_COST, draft_model=model_path)
    async with running(model_path, drafts, speculation=settings) as engine:
        await same_with_and_without_drafts(engine, WORKLOADS["distinct-chat"], drafts)
    # The same model drafting: a draft token is lost only where the two contexts' last bits
    # reorder a near-tie. The lookup keeps far fewer on these prompts.
    assert drafts.drafted >= TOKENS and drafts.accepted >= 0.8 * drafts.drafted, (
        drafts.drafted,
        drafts.accepted,
    )


async def test_an_engine_refuses_a_draft_model_of_another_vocabulary(
    tmp_path: Path, model_path: Path
) -> None:
    other = write_vocab_gguf(tmp_path / "other.gguf")
    engine = LlamaCppEngine(
        model_path,
        context_length=512,
        capacity=1,
        threads=2,
        max_queue=4,
        speculation=SpecSettings(draft_model=other),
    )
    with pytest.raises(EngineUnavailableError, match="another vocabulary than"):
        await engine.start()
    await engine.stop()


async def test_the_server_drafts_with_the_configured_draft_model(
    tmp_path: Path, model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """engine.speculation.draftModel in the runtime config (what the operator renders from
    engine.draftModel) reaches the engine: a reply that does not repeat its prompt drafts."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("m.gguf", "draft.gguf"):
        (models / name).symlink_to(model_path)
    size = model_path.stat().st_size
    config = make_config(tmp_path / "sysfs").model_copy(
        update={
            "model_dir": str(models),
            "files": [
                ModelFile(path=name, sha256="0" * 64, size_bytes=size)
                for name in ("m.gguf", "draft.gguf")
            ],
        }
    )
    config = RuntimeConfig.model_validate(
        {
            **config.model_dump(by_alias=True),
            "engine": {
                **config.engine.model_dump(by_alias=True),
                "speculation": {"draftModel": "draft.gguf"},
            },
        }
    )
    caplog.set_level(logging.INFO, logger="ember_runtime.engines.llamacpp")
    live = start_live(create_app(config))
    try:
        body = {"prompt": WORKLOADS["distinct-chat"][0], "max_tokens": 32, "temperature": 0}
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            metrics = (await client.get("/metrics")).text
    finally:
        live.stop()
    assert "drafts from the draft model draft.gguf" in caplog.text
    assert _metric(metrics, "ember_speculative_accepted_tokens_total") >= 8, metrics[-2000:]


def test_a_draft_decode_that_fails_drafts_nothing_and_the_next_starts_afresh(
    model_path: Path,
) -> None:
    """A draft context that cannot take a sequence's tokens (here: more than its cells) gives
    no draft for that step instead of failing the step; the next draft starts from no cells."""
    drafter = DraftModel(
        model_path,
        served=model_path,
        sequences=1,
        context_length=256,
        threads=2,
        gpu_layers=0,
        repack=True,
    )
    drafter.open(cast(Vocab, SimpleNamespace(size=vocabulary.vocabulary(model_path).size)))
    try:
        owner = object()
        too_long = [1000 + i for i in range(700)]
        assert drafter.draft([Want(0, owner, too_long, 4)]) == {0: []}
        fits = too_long[:40]
        assert len(drafter.draft([Want(0, owner, fits, 4)])[0]) == 4
    finally:
        drafter.close()
