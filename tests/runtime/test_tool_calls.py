"""Tool calls on /v1/chat/completions through the `openai` client, on the real engine and model.

Gemma 3 270M (base) has no chat template, so these run Ember's built-in format
(docs/tool-calls.md); the template path is checked with a Hermes/Qwen-style template string
through the same renderer. A base model of this size writes poor text, so the assertions are
about structure: every call the grammar constrains parses and validates against its schema.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
from ember_runtime.engines import tools as fmt
from ember_runtime.engines.base import ChatMessage, Delta, ToolCall
from ember_runtime.engines.chat import render_template
from ember_runtime.engines.llamacpp import LlamaCppEngine
from ember_runtime.server.toolcalls import ToolPlan, reply
from ember_runtime.server.toolstream import ToolSSEFramer
from openai import AsyncOpenAI

from tests.runtime.conftest import LiveServer
from tests.runtime.test_json_grammar import accepts

MODEL = "gemma-3-270m"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},  # a base model may write on and on
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 32}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} somewhere", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@asynccontextmanager
async def api(server: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180
    ) as client:
        yield client


async def ask(client: AsyncOpenAI, **extra: Any) -> Any:
    args: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, **extra}
    return await client.chat.completions.create(model=MODEL, temperature=0, **args)


def check_call(call: Any, names: frozenset[str] = frozenset(SCHEMAS)) -> dict[str, Any]:
    """A call in OpenAI's shape whose arguments parse and validate; the arguments."""
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return dict(arguments)


# --- the format, the parser, the templates (no model) ---------------------------------------


def test_parser_recognises_the_builtin_hermes_and_bare_json_forms() -> None:
    names = {"get_weather", "get_time"}
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert fmt.parse(one, names) == (None, [("get_time", '{"zone": "UTC"}')])
    two = f"Let me check.\n{one}\n{one.replace('UTC', 'CET')}"
    content, calls = fmt.parse(two, names)
    assert content == "Let me check."
    assert [c[1] for c in calls] == ['{"zone": "UTC"}', '{"zone": "CET"}']
    # Llama 3.x: the whole reply is the call, with "parameters"; arguments as JSON text too
    assert fmt.parse('{"name": "get_time", "parameters": {"zone": "X"}}', names)[1] == [
        ("get_time", '{"zone": "X"}')
    ]
    stringified = (
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"Y\\"}"}</tool_call>'
    )
    assert fmt.parse(stringified, names)[1] == [("get_time", '{"zone": "Y"}')]
    # Not calls: text, unknown functions, broken JSON, a block cut short
    for text in (
        "It is sunny.",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": </tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"zone"',
        '{"name": "get_time"}',
    ):
        assert fmt.parse(text, names) == (text, []), text


def test_builtin_format_puts_tools_calls_and_results_in_plain_turns() -> None:
    call = ToolCall("call_1", "get_time", '{"zone": "UTC"}')
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Time?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "12:00", tool_call_id="call_1"),
        ChatMessage("tool", "13:00", tool_call_id="call_2"),
    ]
    out = fmt.builtin_messages(messages, TOOLS)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content.startswith("Be brief.\n\nYou may call")
    assert json.dumps(TOOLS[1]) in out[0].content
    assert out[2].content == fmt.format_call("get_time", '{"zone": "UTC"}')
    assert fmt.parse(out[2].content, {"get_time"})[1] == [("get_time", '{"zone": "UTC"}')]
    assert out[3].content == (
        "<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>"
    )


# A trimmed Qwen 2.5 template: tools in the system turn, calls with `tojson`, results as
# <tool_response> user turns (the shape of the real one, which llama.cpp's --jinja renders).
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_template_path_passes_tools_calls_and_results_as_jinja_templates_expect() -> None:
    messages = [
        ChatMessage("user", "Weather <in> Oslo & Bergen?"),
        ChatMessage(
            "assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Oslo & <B>"}'),)
        ),
        ChatMessage("tool", "rain", tool_call_id="c1"),
    ]
    text = render_template(QWEN_STYLE, messages, bos_token="", eos_token="", tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text  # tojson is plain JSON (Jinja's own escapes < > &)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo & <B>"}}' in text
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant")
    # What such a model answers is read back by the same parser
    reply = fmt.format_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    assert reply.startswith("<tool_call>\n{") and reply.endswith("}\n</tool_call>")
    assert fmt.parse(reply, set(SCHEMAS))[1][0][0] == "get_weather"


# --- the grammar on the real vocabulary -----------------------------------------------------


def _grammar(*, parallel: bool, free_text: bool, names: tuple[str, ...] = tuple(SCHEMAS)) -> str:
    functions = [fmt.Function(n, SCHEMAS[n]) for n in names]
    return fmt.grammar(functions, parallel=parallel, free_text=free_text)


WEATHER_CALL = fmt.format_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
TIME_CALL = fmt.format_call("get_time", '{"zone": "UTC"}')


def test_call_grammar_admits_only_calls_that_validate(server: LiveServer) -> None:
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    grammar = _grammar(parallel=False, free_text=False)
    for good in (
        WEATHER_CALL,
        TIME_CALL,
        fmt.format_call("get_weather", '{"city": "a\\nb", "unit": "fahrenheit", "days": -3}'),
    ):
        assert accepts(engine, grammar, good), good
    for bad in (
        fmt.format_call("get_weather", '{"city": "Oslo"}'),  # a required argument missing
        fmt.format_call("get_weather", '{"city": "Oslo", "unit": "kelvin"}'),  # not in enum
        fmt.format_call("get_weather", '{"city": "Oslo", "unit": "celsius", "x": 1}'),  # extra
        fmt.format_call("get_weather", '{"city": "Oslo", "unit": "celsius", "days": 1.5}'),
        fmt.format_call("get_weather", '{"city": "Os\nlo", "unit": "celsius"}'),  # raw control
        fmt.format_call("get_date", '{"zone": "UTC"}'),  # not offered
        "Sure! " + TIME_CALL,  # text where only calls may be
        TIME_CALL + "\n" + TIME_CALL,  # a second call with parallel_tool_calls false
    ):
        assert not accepts(engine, grammar, bad), bad
    assert accepts(
        engine, _grammar(parallel=True, free_text=False), TIME_CALL + "\n" + WEATHER_CALL
    )
    named = _grammar(parallel=False, free_text=False, names=("get_time",))
    assert accepts(engine, named, TIME_CALL) and not accepts(engine, named, WEATHER_CALL)


def test_auto_grammar_leaves_text_free_until_a_call_starts(server: LiveServer) -> None:
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    grammar = _grammar(parallel=True, free_text=True)
    for good in (
        "It is sunny in Oslo, <b>mostly</b>; a <tool is not a call.",
        "Checking.\n" + WEATHER_CALL,
        WEATHER_CALL + "\n" + TIME_CALL,
    ):
        assert accepts(engine, grammar, good), good
    for bad in (
        "Checking. <tool_call>\nthe weather please",
        "Checking. <tool_call>\n" + '{"name": "get_time", "arguments": {}}',
        WEATHER_CALL + " and some more text",
    ):
        assert not accepts(engine, grammar, bad), bad


# --- end to end through the openai client ---------------------------------------------------


@pytest.mark.parametrize("choice", ["required", NAMED])
async def test_forced_call_parses_and_validates(server: LiveServer, choice: Any) -> None:
    async with api(server) as client:
        reply = await ask(client, tool_choice=choice, parallel_tool_calls=False)
    (only,) = reply.choices
    assert only.finish_reason == "tool_calls"
    assert only.message.content is None
    (call,) = only.message.tool_calls
    check_call(call, frozenset({"get_time"}) if choice == NAMED else frozenset(SCHEMAS))


@pytest.mark.parametrize("choice", ["required", NAMED])
async def test_streamed_call_deltas_have_openais_shape(server: LiveServer, choice: Any) -> None:
    names = frozenset({"get_time"}) if choice == NAMED else frozenset(SCHEMAS)
    async with api(server) as client:
        chunks = [
            c
            async for c in await ask(
                client, tool_choice=choice, parallel_tool_calls=False, stream=True
            )
        ]
        # The openai package's own stream helper assembles the same call.
        async with client.beta.chat.completions.stream(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=0,
            parallel_tool_calls=False,
        ) as stream:
            final = await stream.get_final_completion()
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or []) if c.choices]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.arguments) == (0, "function", "")
    assert first.id.startswith("call_") and first.function.name in names
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assembled = "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(assembled), SCHEMAS[first.function.name])
    # The helper's call is another request's: greedy output may differ with the batch it
    # shared (README: engine.deterministic), so it is checked on its own.
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    check_call(call, names)


async def test_parallel_calls_each_validate(server: LiveServer) -> None:
    """With the end of generation banned the grammar leaves only more calls, so the reply holds
    several (the last one cut by max_tokens stays text); each complete one validates."""
    async with api(server) as client:
        reply = await ask(
            client, tool_choice="required", max_tokens=160, extra_body={"ignore_eos": True}
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    calls = choice.message.tool_calls or []
    assert len(calls) >= 2
    for call in calls:
        check_call(call)
    assert len({c.id for c in calls}) == len(calls)


async def test_auto_answers_in_text_or_in_valid_calls(server: LiveServer) -> None:
    async with api(server) as client:
        for stream in (False, True):
            reply = await ask(client, tool_choice="auto", stream=stream)
            if stream:
                chunks = [c async for c in reply]
                calls = [
                    t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []
                ]
                assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
                assert all(
                    json.loads(t.function.arguments) is not None
                    for t in calls
                    if t.function.arguments
                )
                continue
            message = reply.choices[0].message
            assert message.content or message.tool_calls
            for call in message.tool_calls or []:
                check_call(call)
        none = await ask(client, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


async def test_a_tool_result_round_trip(server: LiveServer) -> None:
    async with api(server) as client:
        first = await ask(client, tool_choice="required", parallel_tool_calls=False)
        call = first.choices[0].message.tool_calls[0]
        history: list[Any] = [
            *ASK,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 7}'},
        ]
        rendered = server.state.engine.render_chat(
            [
                ChatMessage("user", ASK[0]["content"]),
                ChatMessage(
                    "assistant",
                    "",
                    tool_calls=(ToolCall(call.id, call.function.name, call.function.arguments),),
                ),
                ChatMessage("tool", '{"temperature": 7}', tool_call_id=call.id),
            ],
            TOOLS,
        )
        second = await client.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0
        )
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    assert '<tool_response>\n{"temperature": 7}\n</tool_response>' in rendered
    assert fmt.format_call(call.function.name, call.function.arguments) in rendered


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools"),  # a name twice
        ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "integer", "minimum": 1},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [*ASK, {"role": "tool", "content": "7"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ],
)
async def test_bad_tools_are_400_naming_the_field(
    server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    async with api(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await ask(client, **extra)
    assert info.value.param == param, info.value.body


def test_free_text_fast_path_allows_exactly_what_the_full_check_allows(
    server: LiveServer,
) -> None:
    """Under auto the engine checks only the tokens that could start a call while the text is
    free (engines/grammar_mask.py); step by step it must allow what the full check does."""
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    text = "Wetter in Köln: 7 °C, <b>nass</b> 🌧 <tool_call>\n" + TIME_CALL[len("<tool_call>\n") :]
    grammar = _grammar(parallel=False, free_text=True)
    full = engine.grammars.compile(grammar)
    fast = engine.grammars.compile(grammar, free_until=fmt.OPEN)
    row = np.zeros(engine.vocab.size, np.float32)
    free_steps = 0
    try:
        for tok in engine.tokenize(text, add_special=False):
            free_steps += fast.in_free_text()
            allowed = np.isfinite(full.mask(row))
            quick = np.isfinite(fast.mask(row))
            diff = np.nonzero(allowed != quick)[0][:8]
            pieces = [engine.vocab.token_bytes(int(d), special=True) for d in diff]
            assert not len(diff), (tok, pieces)
            assert allowed[tok]
            full.accept(tok)
            fast.accept(tok)
        assert 5 < free_steps < len(engine.tokenize(text, add_special=False))
    finally:
        full.free()
        fast.free()


# --- streaming: the same reply whatever the chunking -----------------------------------------


def _stream(text: str, cuts: list[int], finish: str, plan: ToolPlan) -> list[str]:
    framer = ToolSSEFramer(plan, model=MODEL, include_usage=False)
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    out = [framer.delta(Delta(p, 1)) or "" for p in pieces]
    return "".join([*out, framer.finish(finish)]).split("\n\n")


def _assemble(events: list[str]) -> tuple[str, list[tuple[str, str, str]], str]:
    """What a client makes of the chunks: content, calls (id, name, arguments), finish."""
    content, calls, finish = "", {}, ""
    for event in filter(None, events):
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            if "id" in tc:  # the first delta of a call, with its name and empty arguments
                assert tc["index"] not in calls and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


STREAMED = [
    ("It is sunny. <b>Really</b> <tool", "stop"),
    ("Checking.\n" + WEATHER_CALL + "\n" + TIME_CALL, "stop"),
    (fmt.format_call("get_time", '{"zone": "}{\\"]"}'), "stop"),  # brackets inside a string
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', "stop"),  # Llama 3.x, whole reply
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"A\\"}"}</tool_call>', "stop"),
    ("Sure " + TIME_CALL[: TIME_CALL.index("TC")], "length"),  # cut short by max_tokens
    ("Sure " + TIME_CALL + "\n" + TIME_CALL[:20], "length"),  # the second call cut short
]


@pytest.mark.parametrize(("text", "finish"), STREAMED)
def test_streamed_reply_is_the_same_reply_however_it_is_chunked(text: str, finish: str) -> None:
    plan = ToolPlan([fmt.Function(n, s) for n, s in SCHEMAS.items()], "auto", parallel=True)
    message, reason = reply(text, finish, plan)
    want_calls = [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
    ]
    rng = random.Random(7)
    chunkings = [[], list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), k)) for k in (3, 9, 27) for _ in range(4)
    ]
    for cuts in chunkings:
        content, calls, got_reason = _assemble(_stream(text, cuts, finish, plan))
        assert got_reason == reason
        assert all(ident.startswith("call_") for ident, _, _ in calls)
        # A call cut short by max_tokens: streamed, its start is out already; whole, dropped.
        extra = len(calls) - len(want_calls)
        assert extra in ((0, 1) if finish == "length" else (0,)), cuts
        complete = calls[: len(want_calls)]
        assert [(name, json.loads(args)) for _, name, args in complete] == want_calls, cuts
        assert content.strip() == (message.content or "").strip(), cuts


def test_the_engine_picks_the_models_template_when_it_knows_tools(server: LiveServer) -> None:
    """The GGUF's template gets `tools` when it knows them; one that does not (or no template,
    as here) gets the conversation in the built-in format."""
    engine = server.state.engine
    assert isinstance(engine, LlamaCppEngine)
    call = ToolCall("c1", "get_time", '{"zone": "UTC"}')
    messages = [
        ChatMessage("user", "Time?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "12:00", tool_call_id="c1"),
    ]
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    saved = engine._chat_template
    try:
        engine._chat_template = QWEN_STYLE
        with_tools = engine.render_chat(messages, TOOLS)
        engine._chat_template = plain
        without = engine.render_chat(messages, TOOLS)
    finally:
        engine._chat_template = saved
    builtin = engine.render_chat(messages, TOOLS)
    assert with_tools == render_template(
        QWEN_STYLE, messages, bos_token="<bos>", eos_token="<eos>", tools=TOOLS
    )
    assert without.startswith("<system>You may call") and "<user><tool_response>" in without
    assert "<start_of_turn>user\nYou may call" in builtin  # llama.cpp's gemma turns
    assert fmt.format_call("get_time", '{"zone": "UTC"}') in builtin
    assert "<tool_response>\n12:00\n</tool_response>" in builtin
