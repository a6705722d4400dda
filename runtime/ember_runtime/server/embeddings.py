"""`/v1/embeddings`, as OpenAI serves it, on a `model.task: embed` deployment.

`input` is a string, a list of strings, a list of token ids or a list of such lists; each is
one vector, in order, with its `index`. `encoding_format` `float` gives JSON numbers, `base64`
the little-endian float32 bytes (what the openai client asks for by default and decodes).
`dimensions` is accepted only at the model's own width: shortening a vector is meaningful only
for models trained for it (Matryoshka), which the GGUF does not say.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ember_runtime.engines.base import Embedder
from ember_runtime.server.errors import APIError
from ember_runtime.server.routes import StateDep, checked_token_ids
from ember_runtime.server.state import AppState, require_api_key

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request

router = APIRouter(dependencies=[Depends(require_api_key)])


class EmbeddingRequest(BaseModel):
    # Strict and closed like every request here (server/schemas.py says why).
    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    # null is float: LiteLLM sends `"encoding_format": null` on every call.
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # labels a request at OpenAI; changes nothing


def _embedder(state: StateDep) -> Embedder:
    """The engine, when this deployment embeds: resolved before the body is read, so a
    generating deployment answers any /v1/embeddings request the same way."""
    engine = state.engine
    if engine.info.task != "embed" or not isinstance(engine, Embedder):
        raise APIError(
            400,
            f"{engine.info.model_id} is served for text generation (model.task generate); "
            "/v1/embeddings needs an InferenceDeployment with model.task embed",
            param="model",
            code="model_not_supported",
        )
    return engine


@router.post("/v1/embeddings", response_model=None)
async def embeddings(
    body: EmbeddingRequest,
    state: StateDep,
    embedder: Annotated[Embedder, Depends(_embedder)],
) -> JSONResponse:
    if body.dimensions is not None and body.dimensions != embedder.dimensions:
        raise APIError(
            400,
            f"dimensions {body.dimensions} is not supported: this model's vectors have "
            f"{embedder.dimensions} dimensions",
            param="dimensions",
            code="unsupported_value",
        )
    inputs = _inputs(body.input, embedder, state)
    tokens = sum(len(ids) for ids in inputs)
    state.metrics.prompt_tokens.inc(tokens)
    try:
        vectors = await asyncio.wait_for(embedder.embed(inputs), state.request_timeout)
    except TimeoutError:
        raise APIError(504, "the embeddings took too long", code="timeout") from None
    encoding = body.encoding_format or "float"
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
        for i, v in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": embedder.info.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def _inputs(
    given: str | list[str] | list[int] | list[list[int]], embedder: Embedder, state: AppState
) -> list[list[int]]:
    """Each input as token ids, in order; a 400 naming `input` for one that cannot be."""
    one = isinstance(given, str) or bool(given and isinstance(given[0], int))
    items: list[str | list[int]] = [given] if one else [*given]  # type: ignore[list-item]
    if not items:
        raise APIError(400, "input must not be empty", param="input", code="empty_input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
    out = [_tokens(item, embedder, state) for item in items]
    limit = embedder.info.context_length
    for i, ids in enumerate(out):
        if len(ids) > limit:
            raise APIError(
                400,
                f"input {i} has {len(ids)} tokens; this model embeds at most {limit}",
                param="input",
                code="context_length_exceeded",
            )
    return out


def _tokens(item: str | list[int], embedder: Embedder, state: AppState) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise APIError(400, "input strings must not be empty", param="input")
        return embedder.tokenize(item, add_special=True)
    return checked_token_ids(item, state, param="input")


def _encoded(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
