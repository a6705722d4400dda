"""/v1/embeddings on the real engine and model, through the `openai` client.

The model is the Gemma 3 270M GGUF the other runtime tests use (no embedding GGUF can be had
here): a generative model, so its GGUF names no pooling and the deployment sets `mean`. The
"pooling from the GGUF" case runs on a copy of that file whose header gains
`gemma3.pooling_type`. What is asserted about meaning is only what this model does reliably:
near-paraphrases score above unrelated sentences.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.engines.base import EngineUnavailableError
from ember_runtime.engines.embedding import Job, LlamaCppEmbedder, check_pooling, plan_step
from ember_runtime.memory import MemoryLimitError
from ember_runtime.server.app import create_app
from ember_runtime.server.preflight import preflight
from gguf import GGUFReader

from tests.runtime.conftest import CONTEXT, LiveServer, make_config, start_live
from tests.runtime.test_memory import fake_cgroup
from tests.support.server_exit import refused_start

SENTENCES = [
    "The cat sat on the mat.",
    "Quarterly revenue rose by ten percent.",
    "How do I reset my password?",
    "The train to Paris leaves at nine.",
    "Photosynthesis turns light into chemical energy.",
]
DIMENSIONS = 640  # Gemma 3 270M's embedding width


def embed_config(tmp: Path, pooling: str | None = "mean") -> RuntimeConfig:
    base = make_config(tmp).model_dump(by_alias=True)
    return RuntimeConfig.model_validate({**base, "task": "embed", "pooling": pooling})


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_live(create_app(embed_config(tmp_path_factory.mktemp("embed"))))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(embedder: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="unused", max_retries=0)


def vectors(reply: openai.types.CreateEmbeddingResponse) -> list[np.ndarray]:
    return [np.asarray(d.embedding, dtype=np.float32) for d in reply.data]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- the API ---------------------------------------------------------------------------------


def test_a_list_of_strings_gives_one_vector_each_in_order(
    client: openai.OpenAI, embedder: LiveServer
) -> None:
    reply = client.embeddings.create(model="gemma-3-270m", input=SENTENCES, encoding_format="float")
    assert reply.object == "list" and reply.model == "gemma-3-270m"
    assert [d.index for d in reply.data] == list(range(len(SENTENCES)))
    assert all(d.object == "embedding" and len(d.embedding) == DIMENSIONS for d in reply.data)
    for vec in vectors(reply):
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-5  # L2-normalised, as OpenAI's are
    engine = embedder.state.engine
    tokens = sum(len(engine.tokenize(s, add_special=True)) for s in SENTENCES)
    assert reply.usage.prompt_tokens == tokens == reply.usage.total_tokens
    # Order is the request's: each vector is its own sentence's, not a neighbour's.
    one = vectors(client.embeddings.create(model="m", input=SENTENCES[3], encoding_format="float"))
    best = max(range(len(SENTENCES)), key=lambda i: cosine(vectors(reply)[i], one[0]))
    assert best == 3


def test_token_ids_embed_like_their_text(client: openai.OpenAI, embedder: LiveServer) -> None:
    ids = [embedder.state.engine.tokenize(s, add_special=True) for s in SENTENCES[:2]]
    text = vectors(client.embeddings.create(model="m", input=SENTENCES[0], encoding_format="float"))
    one = vectors(client.embeddings.create(model="m", input=ids[0], encoding_format="float"))
    assert np.array_equal(text[0], one[0])  # the same tokens in the same call shape
    both = client.embeddings.create(model="m", input=ids, encoding_format="float")
    texts = client.embeddings.create(model="m", input=SENTENCES[:2], encoding_format="float")
    assert [d.index for d in both.data] == [0, 1]
    for a, b in zip(vectors(both), vectors(texts), strict=True):
        assert np.array_equal(a, b)
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_base64_is_the_same_little_endian_float32(embedder: LiveServer) -> None:
    def post(encoding: str) -> list[object]:
        reply = httpx.post(
            f"{embedder.url}/v1/embeddings",
            json={"input": SENTENCES[:2], "encoding_format": encoding},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        return [d["embedding"] for d in reply.json()["data"]]

    floats, encoded = post("float"), post("base64")
    for as_list, as_text in zip(floats, encoded, strict=True):
        assert isinstance(as_text, str)
        decoded = np.frombuffer(base64.b64decode(as_text), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(as_list, dtype=np.float32))


def test_a_null_encoding_format_is_float(embedder: LiveServer) -> None:
    """LiteLLM sends `"encoding_format": null` on every call; OpenAI reads it as float."""
    reply = httpx.post(
        f"{embedder.url}/v1/embeddings",
        json={"input": SENTENCES[0], "encoding_format": None},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert isinstance(reply.json()["data"][0]["embedding"], list)


def test_the_clients_default_base64_decodes_to_the_floats(client: openai.OpenAI) -> None:
    # The openai client asks for base64 when no encoding_format is given and decodes it.
    default = vectors(client.embeddings.create(model="m", input=SENTENCES[:2]))
    floats = vectors(
        client.embeddings.create(model="m", input=SENTENCES[:2], encoding_format="float")
    )
    for a, b in zip(default, floats, strict=True):
        assert np.array_equal(a, b)


def test_a_batch_equals_the_inputs_one_by_one(client: openai.OpenAI) -> None:
    batch = vectors(client.embeddings.create(model="m", input=SENTENCES, encoding_format="float"))
    for sentence, together in zip(SENTENCES, batch, strict=True):
        (alone,) = vectors(
            client.embeddings.create(model="m", input=sentence, encoding_format="float")
        )
        assert cosine(alone, together) > 0.999


def test_identical_inputs_give_identical_vectors(client: openai.OpenAI) -> None:
    request = [SENTENCES[0], SENTENCES[1], SENTENCES[0]]
    first = vectors(client.embeddings.create(model="m", input=request, encoding_format="float"))
    assert np.array_equal(first[0], first[2])
    again = vectors(client.embeddings.create(model="m", input=request, encoding_format="float"))
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a, b)


# Each: a sentence, a near-paraphrase, an unrelated sentence. Checked on this model: mean pooling
# of a generative model still ranks the paraphrase first, by 0.20-0.35 in cosine, for all three.
TRIPLES = [
    ("The cat sat on the mat.", "A kitten is sitting on a rug.", "Interest rates rose again."),
    (
        "How do I reset my password?",
        "I forgot my password and need to change it.",
        "The volcano erupted last night.",
    ),
    (
        "The train to Paris leaves at nine.",
        "The Paris train departs at 9 o'clock.",
        "Bake the bread for forty minutes.",
    ),
]


def test_paraphrases_are_closer_than_unrelated_sentences(client: openai.OpenAI) -> None:
    for anchor, near, far in TRIPLES:
        a, n, f = vectors(
            client.embeddings.create(model="m", input=[anchor, near, far], encoding_format="float")
        )
        assert cosine(a, n) > cosine(a, f), (anchor, cosine(a, n), cosine(a, f))


def test_inputs_share_decodes_up_to_the_batch_limit(
    client: openai.OpenAI, embedder: LiveServer
) -> None:
    engine = embedder.state.engine
    capacity = engine.state().capacity
    before = engine.state().steps
    client.embeddings.create(model="m", input=SENTENCES[:capacity], encoding_format="float")
    assert engine.state().steps == before + 1  # one llama_decode, one seq_id per input
    assert engine.state().last_step_sequences == capacity
    engine.set_max_batch_size(2)  # what the thermal governor does when hot
    try:
        before = engine.state().steps
        client.embeddings.create(model="m", input=SENTENCES[:capacity], encoding_format="float")
        assert engine.state().steps == before + capacity // 2
    finally:
        engine.set_max_batch_size(capacity)


def test_models_lists_the_embedding_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["gemma-3-270m"]


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "must not be empty"),
        ({"input": [[]]}, "input", "must not be empty"),
        ({"input": [10**9]}, "input", "token ids must be within"),
        ({"input": ["a", 3]}, "input", ""),
        ({"input": "x " * (CONTEXT + 10)}, "input", f"at most {CONTEXT}"),
        ({"input": "a", "dimensions": 64}, "dimensions", "640 dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
        ({"input": "a", "truncate": True}, "truncate", "not a parameter"),
        ({}, "input", ""),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    embedder: LiveServer, body: dict[str, object], param: str, words: str
) -> None:
    reply = httpx.post(f"{embedder.url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_dimensions_at_the_models_width_is_accepted(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(
        model="m", input="a", dimensions=DIMENSIONS, encoding_format="float"
    )
    assert len(reply.data[0].embedding) == DIMENSIONS


def test_an_embedding_deployment_refuses_completions_and_chat(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="m", prompt="Hello")
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    for exc in (completion.value, chat.value):
        body = exc.body
        assert isinstance(body, dict) and body["param"] == "model"
        assert "embedding model" in body["message"] and "/v1/embeddings" in body["message"]


def test_a_generating_deployment_refuses_embeddings(server: LiveServer) -> None:
    generating = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        generating.embeddings.create(model="m", input="Hello")
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "model"
    assert "model.task embed" in body["message"]
    # Whatever the body: the deployment's task is the answer, not the body's first flaw.
    bad = httpx.post(f"{server.url}/v1/embeddings", json={"input": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


# --- pooling ---------------------------------------------------------------------------------


def with_uint32(src: Path, dst: Path, key: str, value: int) -> None:
    """A copy of the GGUF `src` with one more header key (a uint32). Tensor offsets are
    relative to the data section, so the tensors are copied as they are, realigned."""
    reader = GGUFReader(src)
    infos_start = reader.tensors[0].field.offset
    last = reader.tensors[-1].field
    infos_end = last.offset + sum(int(part.nbytes) for part in last.parts)
    with src.open("rb") as f, dst.open("wb") as out:
        head = bytearray(f.read(infos_start))
        (count,) = struct.unpack_from("<Q", head, 16)  # after magic, version, tensor count
        struct.pack_into("<Q", head, 16, count + 1)
        name = key.encode()
        entry = struct.pack("<Q", len(name)) + name + struct.pack("<II", 4, value)  # 4: uint32
        out.write(head + entry + f.read(infos_end - infos_start))
        out.write(b"\0" * (-out.tell() % int(reader.alignment)))
        f.seek(reader.data_offset)
        shutil.copyfileobj(f, out, 1 << 22)


@pytest.fixture(scope="module")
def pooled_gguf(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    dst = tmp_path_factory.mktemp("pooled") / "gemma-mean-pooled.gguf"
    with_uint32(model_path, dst, "gemma3.pooling_type", 1)  # llama.cpp's MEAN
    return dst


def engine_for(path: Path, pooling: str | None) -> LlamaCppEmbedder:
    return LlamaCppEmbedder(
        path, context_length=CONTEXT, capacity=2, threads=1, max_queue=4, pooling=pooling
    )


async def embed_once(engine: LlamaCppEmbedder, text: str) -> tuple[str, np.ndarray]:
    await engine.start()
    try:
        (vec,) = await engine.embed([engine.tokenize(text, add_special=True)])
        return engine.info.extra["pooling"], vec
    finally:
        await engine.stop()


def test_pooling_comes_from_the_gguf_unless_the_spec_sets_it(
    pooled_gguf: Path, model_path: Path
) -> None:
    text = SENTENCES[0]
    from_gguf, vec = asyncio.run(embed_once(engine_for(pooled_gguf, None), text))
    assert from_gguf == "mean"
    _, explicit = asyncio.run(embed_once(engine_for(model_path, "mean"), text))
    assert np.array_equal(vec, explicit)
    spec_wins, last = asyncio.run(embed_once(engine_for(pooled_gguf, "last"), text))
    assert spec_wins == "last" and cosine(last, vec) < 0.999


def test_the_header_names_the_pooling_before_the_model_loads(
    pooled_gguf: Path, model_path: Path
) -> None:
    assert check_pooling(pooled_gguf, None) == "mean"
    assert check_pooling(pooled_gguf, "cls") == "cls"
    with pytest.raises(ValueError, match=r"gemma3\.pooling_type is 'none' \(absent"):
        check_pooling(model_path, None)


def test_a_gguf_without_pooling_needs_the_spec_to_name_one(model_path: Path) -> None:
    # The engine's own guard, for an engine built without the server's preflight.
    with pytest.raises(EngineUnavailableError, match=r"set spec\.model\.pooling"):
        asyncio.run(embed_once(engine_for(model_path, None), SENTENCES[0]))


def test_the_runtime_refuses_to_start_without_a_pooling(model_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    config = embed_config(tmp_path / "sysfs", pooling=None).model_copy(
        update={"termination_log": str(log)}
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml())
    reason, detail, stderr = refused_start(path, log, dict(os.environ))
    assert reason == reasons.RUNTIME_START_FAILED
    assert "set spec.model.pooling to mean, cls or last" in detail
    assert "embedding engine ready" not in stderr  # refused before loading the model


def test_the_memory_check_counts_every_token_as_an_output(model_path: Path, tmp_path: Path) -> None:
    # A limit the generating engine fits in (context 512, 4 sequences: ~10 MiB of logits)
    # but the embedding engine does not (512 rows of 262k logits, twice: ~1 GiB).
    generate = make_config(tmp_path / "g").model_copy(
        update={"prewarm_dir": str(model_path.parent)}
    )
    embed = embed_config(tmp_path / "e").model_copy(update={"prewarm_dir": str(model_path.parent)})
    limit = fake_cgroup(tmp_path / "cg", str(768 * 2**20))
    assert preflight(generate, model_path, limit) is not None
    with pytest.raises(MemoryLimitError, match="compute 10"):
        preflight(embed, model_path, limit)


# --- the batch plan (pure) -------------------------------------------------------------------


def test_plan_shares_repeated_inputs_and_keeps_arrival_order() -> None:
    a, b = Job([[1, 2], [3], [1, 2]]), Job([[4, 5, 6], [7]])
    items = plan_step([a, b], max_seqs=3, max_tokens=100)
    assert [(job is a, i) for job, i in items] == [(True, 0), (True, 1), (True, 2), (False, 0)]
    # [7] would be a fourth distinct input: it waits for the next decode.


def test_plan_stops_at_the_token_budget() -> None:
    a, b = Job([[1] * 6]), Job([[2] * 5, [3]])
    items = plan_step([a, b], max_seqs=8, max_tokens=10)
    assert [(job is a, i) for job, i in items] == [(True, 0)]  # b's 5 tokens would make 11
