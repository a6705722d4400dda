"""OpenAI's two logprobs shapes, built from the engine's per-token `TokenLogprob`s.

Completions (legacy): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (one
{token: logprob} dict per position) and `text_offset` (where each token starts in the choice's
text, after the echoed prompt if any). Chat: `content`, a list of {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember_runtime.engines.base import TokenLogprob
from ember_runtime.server.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprobOut,
    TopLogprobOut,
)


def completion(entries: Sequence[TokenLogprob], offset: int, *, top: int) -> CompletionLogprobs:
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        # Two alternatives can detokenize to the same text; the likelier one keeps the key.
        top_logprobs=[{t.token: t.logprob for t in reversed(e.top)} for e in entries]
        if top > 0
        else None,
        text_offset=offsets,
    )


def chat(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprobOut(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token_bytes),
                top_logprobs=[
                    TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))
                    for t in e.top
                ],
            )
            for e in entries
        ]
    )
