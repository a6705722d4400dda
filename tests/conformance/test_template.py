"""bench/templates/gemma.jinja renders Ember's chat prompt for the test GGUF, so that the client
matrix (bench/clients_matrix.py) compares two servers given one prompt, not two templates.

The GGUF has no chat template: Ember renders llama.cpp's built-in `gemma` one (engine side) after
its route has mapped the request's messages (`developer` is `system`). The Jinja file must give
the same text when rendered by Jinja itself and by llama-server started exactly as the matrix
starts it (`--jinja --chat-template-file`), whose `/apply-template` shows its prompt and whose
`/tokenize` its tokens (one `<bos>`: it drops the template's and its tokenizer adds one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ember_runtime.engines.chat import render_template
from ember_runtime.server.schemas import ChatCompletionRequest
from ember_runtime.server.toolcalls import chat_messages

from bench.clients_matrix import GEMMA_TEMPLATE, llama_server
from tests.conformance.conftest import MODEL
from tests.runtime.conftest import LiveServer
from tests.runtime.test_chat_parity import CONVERSATIONS as PARITY_CONVERSATIONS
from tests.runtime.test_chat_parity import _reference_tokens

BOS, EOS = "<bos>", "<eos>"  # Gemma's, as llama-server's GET /props names them
CONVERSATIONS: list[list[dict[str, Any]]] = [
    *PARITY_CONVERSATIONS,
    [  # OpenAI's newer system role; two system turns, joined as llama.cpp joins them
        {"role": "developer", "content": "Be terse. "},
        {"role": "system", "content": " Use English."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": " Hello. "},
        {"role": "user", "content": "\tName a colour.\n"},
    ],
    [  # a system turn after the model's: it opens the next user turn
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "Two."},
        {"role": "system", "content": "Count on."},
        {"role": "user", "content": "Three?"},
    ],
]


def ember_prompt(live: LiveServer, messages: list[dict[str, Any]]) -> str:
    """The prompt Ember's chat route renders for these messages."""
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
    return live.state.engine.render_chat(chat_messages(body))


@pytest.fixture(scope="module")
def matrix_llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(False, tmp_path_factory.mktemp("clients-llama-server")) as (url, _):
        yield url


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_jinja_renders_embers_prompt(ember: LiveServer, index: int) -> None:
    messages = CONVERSATIONS[index]
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
    template = GEMMA_TEMPLATE.read_text()
    rendered = render_template(template, chat_messages(body), bos_token=BOS, eos_token=EOS)
    assert rendered == ember_prompt(ember, messages)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_llama_server_renders_embers_prompt(
    ember: LiveServer, matrix_llama_server: str, index: int
) -> None:
    messages = CONVERSATIONS[index]
    ours = ember_prompt(ember, messages)
    reply = httpx.post(matrix_llama_server + "/apply-template", json={"messages": messages})
    reply.raise_for_status()
    assert BOS + reply.json()["prompt"] == ours
    tokens = ember.state.engine.tokenize(ours, add_special=False)  # as the chat route does
    assert _reference_tokens(matrix_llama_server, messages) == tokens
