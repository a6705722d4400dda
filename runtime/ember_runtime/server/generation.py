"""Driving one engine stream for one HTTP request: timeouts, disconnects, metrics, SSE framing.

Per-token work is kept to a dict-free string concatenation: each chunk is a pre-serialised
prefix, `json.dumps(text)`, and a pre-serialised suffix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from ember_runtime.contract.errors import error_body
from ember_runtime.engines.base import Delta, FinishReason, GenerationStream, TokenLogprob
from ember_runtime.server import logprobs
from ember_runtime.server.health import RequestHealth
from ember_runtime.server.metrics import Metrics
from ember_runtime.server.schemas import Usage


@dataclass(slots=True)
class Outcome:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


class Generation:
    """Iterates a stream with the per-request timeout, recording TTFT and inter-token latency
    (and, given the request's `health` probe, its TTFT and how it ended for `server.health`)."""

    def __init__(
        self,
        stream: GenerationStream,
        metrics: Metrics,
        timeout: float,
        health: RequestHealth | None = None,
    ) -> None:
        self.stream = stream
        self.outcome = Outcome()
        self._metrics = metrics
        self._timeout = timeout
        self._health = health
        if health is not None:
            health.generating = True
        self._started = time.perf_counter()
        self._last: float | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas; always leaves the stream finished or cancelled (slot freed)."""
        finished = False
        try:
            async with asyncio.timeout(self._timeout):
                async for delta in self.stream:
                    self._record(delta)
                    finished = delta.finish_reason is not None
                    yield delta
        except TimeoutError:
            self.outcome.finish_reason = "timeout"
            self.outcome.error = f"the request exceeded its {self._timeout:g} s timeout"
        finally:
            if not finished:
                self.stream.cancel()
            reason = self.outcome.finish_reason or FinishReason.CANCELLED.value
            self._metrics.finished.labels(reason=reason).inc()
            if self._health is not None:
                self._health.ended(reason)

    def _record(self, delta: Delta) -> None:
        if delta.n_tokens:
            now = time.perf_counter()
            if self._last is None:
                self._first_token(now - self._started)
            else:
                self._metrics.inter_token.observe(now - self._last)
            self._last = now
            self._metrics.generated_tokens.inc(delta.n_tokens)
            self.outcome.completion_tokens += delta.n_tokens
        if delta.text:
            self.outcome.text.append(delta.text)
        if delta.logprobs:
            self.outcome.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.outcome.finish_reason = delta.finish_reason.value
            self.outcome.error = delta.error

    def _first_token(self, seconds: float) -> None:
        self._metrics.ttft.observe(seconds)
        if self._health is not None:
            self._health.first_token(seconds)

    async def run(self) -> Outcome:
        async for _ in self.deltas():
            pass
        return self.outcome


async def collect(gens: list[Generation], request: Request) -> list[Outcome]:
    """Run every choice to its end for a non-streaming response, all cancelled if the client
    leaves (one watcher: each ASGI message is received once)."""
    watcher = asyncio.create_task(_watch_disconnect(request, gens))
    try:
        return list(await asyncio.gather(*(gen.run() for gen in gens)))
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _watch_disconnect(request: Request, gens: list[Generation]) -> None:
    # The body is already read, so the next ASGI message is the client going away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for gen in gens:
                gen.stream.cancel()
            return


def total_usage(gens: list[Generation]) -> Usage:
    prompt = sum(gen.stream.prompt_tokens for gen in gens)
    done = sum(gen.outcome.completion_tokens for gen in gens)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class SSEFramer:
    """Builds `data: ...\\n\\n` chunks for completions or chat completions."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        include_usage: bool,
        logprobs: int | None = None,
        echo: str = "",
        index: int = 0,
        ident: str | None = None,
    ) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self.logprobs = logprobs  # None: no logprobs; else the number of alternatives
        self.echo = echo
        self._offset = len(echo)  # completions' text_offset of the next token
        kind = "chat.completion.chunk" if chat else "text_completion"
        ident = ident or new_id("chatcmpl" if chat else "cmpl")
        head = (
            f'data: {{"id":"{ident}","object":"{kind}","created":{int(time.time())},'
            f'"model":{json.dumps(model)},"choices":[{{"index":{index},'
        )
        self._head = head
        self._usage_head = head.split('"choices"', maxsplit=1)[0]
        if chat:
            self._text_prefix = head + '"delta":{"content":'
            self._text_suffix = '},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._text_prefix = head + '"text":'
            self._text_suffix = ',"logprobs":null,"finish_reason":null}]}\n\n'

    def opening(self) -> str | None:
        if not self.chat:
            return self.text(self.echo) if self.echo else None
        role = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
        return self._head + role + "\n\n"

    def text(self, text: str) -> str:
        return self._text_prefix + json.dumps(text, ensure_ascii=False) + self._text_suffix

    def delta(self, delta: Delta) -> str | None:
        """The chunk for one engine delta (None when it carries nothing to send)."""
        if self.logprobs is None or not delta.logprobs:
            return self.text(delta.text) if delta.text else None
        if self.chat:
            lp = logprobs.chat(delta.logprobs).model_dump_json()
        else:
            entries = logprobs.completion(delta.logprobs, self._offset, top=self.logprobs)
            lp = entries.model_dump_json()
            self._offset += sum(len(e.token) for e in delta.logprobs)
        head = self._text_prefix + json.dumps(delta.text, ensure_ascii=False)
        return f'{head}{"}" if self.chat else ""},"logprobs":{lp},"finish_reason":null}}]}}\n\n'

    def finish(self, reason: str) -> str:
        body = '"delta":{}' if self.chat else '"text":""'
        return f'{self._head}{body},"logprobs":null,"finish_reason":"{reason}"}}]}}\n\n'

    def usage(self, usage: Usage) -> str:
        return f'{self._usage_head}"choices":[],"usage":{usage.model_dump_json()}}}\n\n'

    @staticmethod
    def error(status: int, message: str, code: str) -> str:
        return f"data: {json.dumps(error_body(status, message, code=code))}\n\n"


DONE = "data: [DONE]\n\n"


async def choice_events(gen: Generation, framer: SSEFramer) -> AsyncIterator[str]:
    """One choice's chunks, its finish (or error) included."""
    opening = framer.opening()
    if opening is not None:
        yield opening
    async for delta in gen.deltas():
        chunk = framer.delta(delta)
        if chunk is not None:
            yield chunk
    reason = gen.outcome.finish_reason
    if reason == "timeout":
        yield framer.error(504, gen.outcome.error or "timeout", "timeout")
    elif reason == FinishReason.ERROR.value:
        yield framer.error(500, gen.outcome.error or "engine error", "engine_error")
    elif reason is not None and reason != FinishReason.CANCELLED.value:
        yield framer.finish(reason)


async def sse_events(gens: list[Generation], framers: list[SSEFramer]) -> AsyncIterator[str]:
    """Every choice's chunks as they come (interleaved for several), then the usage (when
    asked, once every choice finished) and [DONE]."""
    if len(gens) == 1:
        events = choice_events(gens[0], framers[0])
    else:
        events = _merged([choice_events(g, f) for g, f in zip(gens, framers, strict=True)])
    async for chunk in events:
        yield chunk
    ended = [g.outcome.finish_reason for g in gens]
    stopped = (None, "timeout", FinishReason.CANCELLED.value, FinishReason.ERROR.value)
    normal = all(reason not in stopped for reason in ended)
    if framers[0].include_usage and normal:
        yield framers[0].usage(total_usage(gens))
    yield DONE


async def _merged(sources: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """Chunks from several iterators in arrival order; closing this closes them all (so a
    client that leaves cancels every choice)."""
    # Unbounded: what a slow client leaves queued is at most the choices' own tokens.
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(source: AsyncIterator[str]) -> None:
        try:
            async for chunk in source:
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        open_sources = len(tasks)
        while open_sources:
            chunk = await queue.get()
            if chunk is None:
                open_sources -= 1
            else:
                yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
