"""OpenAI-compatible endpoints plus health, readiness and metrics."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember_runtime.engines.base import (
    FinishReason,
    GenerationStream,
    SamplingParams,
)
from ember_runtime.server import health, logprobs, toolcalls
from ember_runtime.server.errors import APIError
from ember_runtime.server.generation import (
    Generation,
    Outcome,
    SSEFramer,
    collect,
    new_id,
    sse_events,
    total_usage,
)
from ember_runtime.server.schemas import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from ember_runtime.server.state import AppState, get_state, require_api_key
from ember_runtime.server.toolstream import ToolSSEFramer

api = APIRouter(dependencies=[Depends(require_api_key)])
probes = APIRouter()

StateDep = Annotated[AppState, Depends(get_state)]
_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@probes.get("/healthz", include_in_schema=False)
async def healthz() -> PlainTextResponse:
    return PlainTextResponse("ok")


@probes.get("/readyz", include_in_schema=False)
async def readyz(state: StateDep) -> PlainTextResponse:
    if state.ready and not state.draining:
        return PlainTextResponse("ready")
    return PlainTextResponse("draining" if state.draining else "loading", status_code=503)


@probes.get("/metrics", include_in_schema=False)
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@api.get("/v1/models")
async def list_models(state: StateDep) -> ModelList:
    info = state.engine.info
    ids = [info.model_id, *info.adapters]  # each served LoRA adapter is a model of its own
    return ModelList(data=[ModelCard(id=i, created=state.started) for i in ids])


def _adapter(body: CompletionRequest | ChatCompletionRequest, state: AppState) -> str | None:
    """The served LoRA adapter the request's `model` names; None for the base (its own id, or
    any other name: clients that send a fixed model id keep working). A refused adapter, or one
    removed while serving, is a 404 that says why."""
    info = state.engine.info
    if body.model in info.adapters:
        return body.model
    reason = info.refused_adapters.get(body.model or "")
    if reason is None and body.model in info.removed_adapters:
        reason = "removed from engine.adapters"
    if reason is not None:
        raise APIError(
            404,
            f"adapter {body.model} is not served: {reason}",
            param="model",
            code="model_not_found",
        )
    return None


def _generating(state: StateDep) -> None:
    """Completions and chat need a generating model; an embedding deployment says so."""
    if state.engine.info.task != "generate":
        raise APIError(
            400,
            f"{state.engine.info.model_id} is an embedding model (model.task "
            f"{state.engine.info.task}): it serves /v1/embeddings only",
            param="model",
            code="model_not_supported",
        )


@api.post("/v1/completions", response_model=None, dependencies=[Depends(_generating)])
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    _refuse_unsupported(body)
    if body.echo and body.logprobs is not None:
        # OpenAI would score the echoed prompt tokens too; the engine keeps no prompt logits.
        raise APIError(
            400, "echo together with logprobs is not supported", param="echo", code="unsupported"
        )
    choices = []
    for text, tokens in _prompts(body.prompt, state):
        if body.echo and text is None:
            raise APIError(400, "echo needs a text prompt here", param="echo", code="unsupported")
        params = _sampling(
            body, tokens, state, default_max=_DEFAULT_COMPLETION_TOKENS, logprobs=body.logprobs
        )
        choices.append(_Choice(tokens, params, text if body.echo and text else ""))
    return await _respond(body, _times_n(choices, body.n), request, state)


def _prompts(
    prompt: str | list[int] | list[str] | list[list[int]], state: AppState
) -> list[tuple[str | None, list[int]]]:
    """Each prompt of a completions request as (its text, or None for token ids; its tokens),
    in order: OpenAI answers one choice per prompt, `index` matching."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        prompts: list[str | list[int]] = [prompt]  # type: ignore[list-item]
    else:
        prompts = list(prompt)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out: list[tuple[str | None, list[int]]] = []
    for one in prompts:
        if isinstance(one, str):
            if not one:
                raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
            out.append((one, state.engine.tokenize(one, add_special=True)))
        else:
            out.append((None, checked_token_ids(one, state)))
    return out


@api.post("/v1/chat/completions", response_model=None, dependencies=[Depends(_generating)])
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    tools = toolcalls.plan(body)
    messages = toolcalls.chat_messages(body)
    try:
        prompt = state.engine.render_chat(messages, tools.tool_objects() if tools else None)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template") from exc
    tokens = state.engine.tokenize(prompt, add_special=False)
    if body.max_completion_tokens is not None:
        body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
    params = _sampling(
        body,
        tokens,
        state,
        default_max=None,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        grammar=_grammar(body, state, tools),
    )
    if tools is not None:
        params = replace(params, grammar_free_until=tools.free_until)
    choices = _times_n([_Choice(tokens, params)], body.n)
    return await _respond(body, choices, request, state, tools)


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(
            400,
            f"{name} is not supported by this server",
            param=name,
            code="unsupported_parameter",
        )


def _grammar(
    body: ChatCompletionRequest, state: AppState, tools: toolcalls.ToolPlan | None
) -> str | None:
    fmt = body.response_format
    if tools is not None:
        return _tools_grammar(body, state, tools)
    if fmt is None or fmt.type == "text":
        return None
    _require(state, "grammar", "response_format")
    from ember_runtime.engines.grammar import for_response_format  # noqa: PLC0415 - llamacpp

    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise APIError(
            400, "response_format json_schema needs json_schema", param="response_format"
        )
    strict = fmt.json_schema is not None and bool(fmt.json_schema.strict)
    return for_response_format(fmt.type, schema, strict=strict)


def _tools_grammar(
    body: ChatCompletionRequest, state: AppState, tools: toolcalls.ToolPlan
) -> str | None:
    """Calls constrained by their schemas; under `auto` only where the engine has grammars
    (elsewhere the text is parsed as it comes)."""
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(
            400,
            "response_format cannot be combined with tools unless tool_choice is none",
            param="response_format",
            code="unsupported_parameter",
        )
    if body.stream and body.logprobs:
        raise APIError(
            400,
            "streamed logprobs with tools are not supported",
            param="logprobs",
            code="unsupported",
        )
    if tools.mode == "auto" and "grammar" not in state.engine.info.features:
        return None
    _require(state, "grammar", "tool_choice")
    return tools.grammar()


def _require(state: AppState, feature: str, param: str) -> None:
    if feature not in state.engine.info.features:
        raise APIError(
            400,
            f"{param} is not supported by the {state.engine.info.name} engine",
            param=param,
            code="unsupported_parameter",
        )


def checked_token_ids(ids: list[int], state: AppState, *, param: str = "prompt") -> list[int]:
    if not ids:
        raise APIError(400, f"{param} must not be empty", param=param, code=f"empty_{param}")
    vocab = state.engine.info.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise APIError(400, f"token ids must be within 0..{vocab - 1}", param=param)
    return ids


def _sampling(
    body: CompletionRequest | ChatCompletionRequest,
    tokens: list[int],
    state: AppState,
    *,
    default_max: int | None,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> SamplingParams:
    body = with_defaults(body, state.sampling_defaults)
    adapter = _adapter(body, state)  # a refused adapter's 404 before anything is counted
    context = state.engine.info.context_length
    room = context - len(tokens)
    if room <= 0:
        raise APIError(
            400,
            f"the prompt has {len(tokens)} tokens; the context holds {context}",
            param="prompt" if isinstance(body, CompletionRequest) else "messages",
            code="context_length_exceeded",
        )
    wanted = body.max_tokens if body.max_tokens is not None else (default_max or room)
    if wanted > room:
        raise APIError(
            400,
            f"max_tokens {wanted} plus {len(tokens)} prompt tokens exceeds the context of "
            f"{context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if logprobs is not None:
        _require(state, "logprobs", "logprobs")
    extras = _llama_sampling(body, state)
    state.metrics.prompt_tokens.inc(len(tokens))
    return SamplingParams(
        max_tokens=wanted,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        logprobs=logprobs,
        grammar=grammar,
        adapter=adapter,
        **extras,
    )


def with_defaults(
    body: CompletionRequest | ChatCompletionRequest, defaults: dict[str, float | int]
) -> CompletionRequest | ChatCompletionRequest:
    """`body` with the deployment's sampling defaults (`spec.sampling`) in the fields it left
    out; a field the client sent, even at the server's default value, is the client's."""
    missing = {k: v for k, v in defaults.items() if k not in body.model_fields_set}
    return body.model_copy(update=missing) if missing else body


# llama-server's sampling fields and the values at which they change nothing.
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "top_k": (0,),
    "min_p": (0.0,),
    "typical_p": (1.0,),
    "min_keep": (0,),
    "repeat_penalty": (1.0,),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "logit_bias": (None, {}, []),
    "ignore_eos": (False,),
}


def _llama_sampling(
    body: CompletionRequest | ChatCompletionRequest, state: AppState
) -> dict[str, Any]:
    """The request's llama-server sampling fields as SamplingParams fields; a 400 naming the
    first one set to a value that matters when the engine does not implement them."""
    if "sampling" not in state.engine.info.features:
        for name, harmless in _HARMLESS.items():
            if getattr(body, name) not in harmless:
                _require(state, "sampling", name)
        return {}
    context = state.engine.info.context_length
    return {
        "top_k": max(0, body.top_k),
        "min_p": body.min_p,
        "typical_p": body.typical_p,
        "min_keep": body.min_keep,
        "repeat_penalty": body.repeat_penalty,
        "repeat_last_n": context if body.repeat_last_n == -1 else body.repeat_last_n,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": _logit_bias(body.logit_bias, state),
        "ignore_eos": body.ignore_eos,
        "speculative": body.speculative is not False,
    }


def _logit_bias(
    bias: dict[str, float] | list[list[Any]] | None, state: AppState
) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"id": bias} or llama-server's [[id or text, bias or false]] as (id, bias)
    pairs; false bans (-inf), a text entry biases each of its tokens."""
    if not bias:
        return ()
    vocab = state.engine.info.vocab_size
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items() if isinstance(bias, dict) else map(_bias_pair, bias):
        add = -math.inf if value is False else float(value)
        if value is not False and not math.isfinite(add):  # JSON's Infinity/NaN parse here
            raise APIError(400, "logit_bias values must be finite numbers", param="logit_bias")
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            if isinstance(bias, dict):
                raise APIError(400, "logit_bias keys are token ids", param="logit_bias")
            pairs += [(t, add) for t in state.engine.tokenize(key, add_special=False)]
            continue
        if not 0 <= int(key) < vocab:
            raise APIError(
                400, f"logit_bias token ids must be within 0..{vocab - 1}", param="logit_bias"
            )
        pairs.append((int(key), add))
    return tuple(pairs)


def _bias_pair(entry: list[Any]) -> tuple[int | str, float | bool]:
    """One llama-server logit_bias entry: [token id or text, a finite number or false]."""
    ok = len(entry) == 2 and isinstance(entry[0], int | str) and not isinstance(entry[0], bool)
    value = entry[1] if ok else None
    if value is not False and (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    ):
        raise APIError(
            400,
            "logit_bias entries are [token id or text, a number or false]",
            param="logit_bias",
        )
    return entry[0], value


@dataclass(frozen=True, slots=True)
class _Choice:
    tokens: list[int]
    params: SamplingParams
    echo: str = ""


def _times_n(choices: list[_Choice], n: int) -> list[_Choice]:
    """`n` samples of every prompt, in OpenAI's order (index = prompt x n + sample). With a
    `seed`, sample j draws with seed + j: the same seed for all would give n equal choices."""
    if len(choices) * n > MAX_CHOICES:
        raise APIError(400, f"prompts x n must be at most {MAX_CHOICES}", param="n")
    out = []
    for choice in choices:
        for j in range(n):
            seed = choice.params.seed
            params = choice.params if seed is None else replace(choice.params, seed=seed + j)
            out.append(replace(choice, params=params))
    return out


def _submit(choices: list[_Choice], state: AppState) -> list[GenerationStream]:
    """Every choice into the engine's queue, or none: a full queue (429) for a later one
    cancels those already in."""
    streams: list[GenerationStream] = []
    try:
        for choice in choices:
            streams.append(state.engine.submit(choice.tokens, choice.params))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


async def _respond(
    body: CompletionRequest | ChatCompletionRequest,
    choices: list[_Choice],
    request: Request,
    state: AppState,
    tools: toolcalls.ToolPlan | None = None,
) -> Response:
    streams = _submit(choices, state)  # QueueFullError -> 429 right here
    probe = health.probe_of(request)
    gens = [Generation(s, state.metrics, state.request_timeout, probe) for s in streams]
    model = choices[0].params.adapter or state.engine.info.model_id
    if body.stream:
        chat = isinstance(body, ChatCompletionRequest)
        ident = new_id("chatcmpl" if chat else "cmpl")
        framers = [
            _framer(c, i, chat=chat, model=model, ident=ident, body=body, tools=tools)
            for i, c in enumerate(choices)
        ]
        return StreamingResponse(
            sse_events(gens, framers),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    outcomes = await collect(gens, request)
    for outcome in outcomes:
        if outcome.finish_reason == "timeout":
            raise APIError(504, outcome.error or "timeout", code="timeout")
        if outcome.finish_reason in (FinishReason.ERROR.value, FinishReason.CANCELLED.value):
            raise APIError(500, outcome.error or "generation was interrupted", code="engine_error")
    if isinstance(body, ChatCompletionRequest):
        return _chat_reply(choices, outcomes, model, gens, tools)
    return _completion_reply(choices, outcomes, model, gens)


def _framer(
    choice: _Choice,
    index: int,
    *,
    chat: bool,
    model: str,
    ident: str,
    body: CompletionRequest | ChatCompletionRequest,
    tools: toolcalls.ToolPlan | None,
) -> SSEFramer:
    common: dict[str, Any] = {
        "model": model,
        "include_usage": body.include_usage,
        "index": index,
        "ident": ident,
    }
    if tools is not None:
        return ToolSSEFramer(tools, **common)
    return SSEFramer(chat=chat, logprobs=choice.params.logprobs, echo=choice.echo, **common)


def _chat_reply(
    choices: list[_Choice],
    outcomes: list[Outcome],
    model: str,
    gens: list[Generation],
    tools: toolcalls.ToolPlan | None,
) -> JSONResponse:
    out = []
    for i, (c, o) in enumerate(zip(choices, outcomes, strict=True)):
        text, reason = "".join(o.text), o.finish_reason
        message = ChatMessageOut(content=text)
        if tools is not None:
            message, reason = toolcalls.reply(text, reason, tools)
        lp = None if c.params.logprobs is None else logprobs.chat(o.logprobs)
        out.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=lp))
    reply = ChatCompletionResponse(
        id=new_id("chatcmpl"),
        created=int(time.time()),
        model=model,
        choices=out,
        usage=total_usage(gens),
    )
    return JSONResponse(reply.model_dump())


def _completion_reply(
    choices: list[_Choice], outcomes: list[Outcome], model: str, gens: list[Generation]
) -> JSONResponse:
    out = []
    for i, (c, o) in enumerate(zip(choices, outcomes, strict=True)):
        top = c.params.logprobs
        lp = None if top is None else logprobs.completion(o.logprobs, len(c.echo), top=top)
        out.append(
            CompletionChoice(
                index=i, text=c.echo + "".join(o.text), finish_reason=o.finish_reason, logprobs=lp
            )
        )
    reply = CompletionResponse(
        id=new_id("cmpl"),
        created=int(time.time()),
        model=model,
        choices=out,
        usage=total_usage(gens),
    )
    return JSONResponse(reply.model_dump())
