"""Ember's chat path against llama.cpp's own `llama-server` on the same GGUF: same prompt tokens,
same greedy reply.

This GGUF (google/gemma-3-270m, the pretrained base checkpoint) has no `tokenizer.chat_template`.
Ember then renders llama.cpp's built-in template for the architecture (`gemma`); llama-server's
own fallback for a template-less model is ChatML, whose `<|im_start|>` markers are not Gemma
tokens at all (they are tokenized as plain text), so the reference runs with
`--chat-template gemma` (no Jinja) and `--no-repack` (Ember's default weight layout). Any
difference in template text, BOS handling (one `<bos>`, not two), special-token parsing or the
end-of-turn stop shows up here as different tokens.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.engines.base import ChatMessage

from images.llama_build import ensure_llama_server
from tests.runtime.conftest import CONTEXT, LiveServer
from tests.support.net import free_port
from tests.support.waiting import wait_for

DEMO_QUESTION = "In one sentence, why do edge devices throttle when they get hot?"  # make demo
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": DEMO_QUESTION}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Name two primes.  "},  # Gemma's template trims content
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Translate 'Grüße' and 'こんにちは' to English."},
    ],
    [{"role": "user", "content": "Say <start_of_turn> and <end_of_turn> literally."}],
]


@contextmanager
def reference_llama_server(model_path: Path, log_dir: Path, *extra: str) -> Iterator[str]:
    """llama-server laid out as the deterministic engine runs (plain, not repacked, weights;
    one sequence; 1 thread; Gemma's built-in template), `extra` flags added; its URL."""
    binary = ensure_llama_server()  # built once from the same llama.cpp as the bindings
    port = free_port()
    argv = [str(binary), "-m", str(model_path), *extra, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", "1", "-c", str(CONTEXT), "-np", "1", "--no-repack"]
    argv += ["--no-jinja", "--chat-template", "gemma"]
    with (log_dir / "log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def llama_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with reference_llama_server(model_path, tmp_path_factory.mktemp("llama-server")) as url:
        yield url


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        return httpx.get(url + "/health", timeout=5).status_code == 200

    wait_for("llama-server to be healthy", healthy, 120, 0.25, tolerate=(httpx.TransportError,))


def _reference_tokens(url: str, messages: list[dict[str, str]]) -> list[int]:
    """What llama-server decodes for a chat request: its template, then tokenize as its
    chat path does (add_special=true, parse_special=true)."""
    rendered = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=30)
    rendered.raise_for_status()
    body = {"content": rendered.json()["prompt"], "add_special": True, "parse_special": True}
    tokens = httpx.post(url + "/tokenize", json=body, timeout=30)
    tokens.raise_for_status()
    ids: list[int] = tokens.json()["tokens"]
    return ids


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_prompt_tokens_match_llama_server(
    server: LiveServer, llama_server: str, index: int
) -> None:
    messages = CONVERSATIONS[index]
    engine = server.state.engine
    rendered = engine.render_chat([ChatMessage(m["role"], m["content"]) for m in messages])
    ours = engine.tokenize(rendered, add_special=False)  # as the chat route tokenizes it
    assert ours == _reference_tokens(llama_server, messages)
    assert ours.count(2) == 1  # exactly one <bos>


async def _chat(
    url: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


# Greedy text from two programs is equal only while every kernel choice on the way is equal
# (batch shape, prompt chunking, threads, the CPU's instruction set: see the engine's notes):
# where the top two tokens are nearly tied, a last-bit difference in the logits picks the
# other one, and the texts part from there on. (This model's reply to the third conversation
# starts with a tie: its top two first tokens are 0.02 apart.) So the replies are walked token
# by token along llama-server's: they may part only at a *close call*, a step where
# llama-server's top two candidates are within CLEAR_MARGIN (natural log-probability) of each
# other — kernel rounding moves logits by far less. Parting anywhere else is a real difference
# (template, BOS, special tokens, sampling, stop handling).
CLEAR_MARGIN = 1.0


def _parting(ours: bytes, steps: list[dict[str, Any]]) -> tuple[int, float | None]:
    """Walk llama-server's tokens along our reply: (tokens that agree, the margin at the step
    where the replies part, or None when all of llama-server's tokens agree)."""
    pos = 0
    for n, entry in enumerate(steps):
        token = bytes(entry["bytes"])
        if ours.startswith(token, pos):
            pos += len(token)
            continue
        top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        return n, (top[0] - top[1]) if len(top) > 1 else float("inf")
    return len(steps), None


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
async def test_greedy_chat_reply_matches_llama_server(
    server: LiveServer, llama_server: str, index: int
) -> None:
    messages = CONVERSATIONS[index]
    ours = await _chat(server.url, messages, max_tokens=32)
    theirs = await _chat(llama_server, messages, max_tokens=32, logprobs=True, top_logprobs=2)
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    (choice,) = theirs["choices"]
    text = ours["choices"][0]["message"]["content"]
    agreed, margin = _parting(text.encode(), choice["logprobs"]["content"])
    if margin is not None:  # parted: only where llama-server itself hesitated
        assert margin < CLEAR_MARGIN, (agreed, margin, text, choice["message"]["content"])
        return
    assert text == choice["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
