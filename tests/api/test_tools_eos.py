"""Forced calls on a checkpoint whose generation_config.json lists several EOS ids (special and
text tokens, as the one that cut Qwen Code's call): complete and schema-valid 20 times out of 20
through chat, Responses and Messages, streamed and not, sampled at temperature 1.0, with a
Hermes template and with the generic format; a call cut by the token limit is reported as cut
on each API."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from llm_server.testing.tiny import CHATML_TEMPLATE, HERMES_TEMPLATE, build_tiny_checkpoint
from tests.api.helpers import WEATHER_SCHEMA
from tests.test_tool_eos import write_eos_list

RUNS = 20
MAX = 200  # a 12-character city can take 36 byte tokens on this tokenizer
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
ANT_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["hermes", "generic"])
def eos_server(request, tmp_path_factory):
    """A Hermes template, and plain ChatML (the generic format)."""
    from llm_server.testing.live import serving

    template = HERMES_TEMPLATE if request.param == "hermes" else CHATML_TEMPLATE
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("eos") / "tiny-eos", chat_template=template
    )
    write_eos_list(path, path / "tokenizer.json")
    with serving(path, concurrent=8) as srv:
        assert len(srv.service.tokenizer.eos_token_ids) == 6
        assert srv.service.syntax.tool_parser == request.param
        yield srv


@pytest.fixture(scope="module")
def oai(eos_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=eos_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(eos_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=eos_server.url, api_key="unused", max_retries=0)


def _chat(oai, seed: int, stream: bool, max_tokens: int = MAX) -> tuple[str, list, str]:
    """(finish_reason, [(name, arguments)], content) of one named call."""
    kw = dict(
        model="default",
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice=NAMED,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
    )
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.finish_reason, calls, choice.message.content or ""
    calls, content, finish = [], "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.function.name:
                calls.append((d.function.name, ""))
            if d.function.arguments:
                calls[d.index] = (calls[d.index][0], calls[d.index][1] + d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return finish, calls, content


def _responses(oai, stream: bool, max_tokens: int = MAX):
    kw = dict(
        model="default",
        input=ASK[0]["content"],
        tools=RESP_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=max_tokens,
    )
    if not stream:
        return oai.responses.create(**kw)
    ends = ("response.completed", "response.incomplete")  # get_final_response: completed only
    with oai.responses.stream(**kw) as s:
        (last,) = [e.response for e in s if e.type in ends]
    return last


def _messages(ant, stream: bool, max_tokens: int = MAX):
    kw = dict(
        model="default",
        messages=ASK,
        tools=ANT_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=max_tokens,
        extra_body={"temperature": 1.0},  # the SDK has no temperature argument any more
    )
    if not stream:
        return ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_forced_calls_complete_20_of_20(oai, stream):
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda s: _chat(oai, s, stream), range(RUNS)))
    for finish, calls, content in runs:
        assert finish == "tool_calls" and not content
        ((name, arguments),) = calls
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_calls_complete_20_of_20(oai, stream):
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda _: _responses(oai, stream), range(RUNS)))
    for r in runs:
        assert r.status == "completed"
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_calls_complete_20_of_20(ant, stream):
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda _: _messages(ant, stream), range(RUNS)))
    for m in runs:
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_call_is_reported_as_cut(eos_server, oai, ant, stream):
    # a limit two tokens into the arguments
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"'
    cut = len(eos_server.service.tokenizer.encode(head, add_special_tokens=False)) + 2
    finish, calls, content = _chat(oai, 0, stream, cut)
    assert finish == "length" and "<tool_call>" not in content
    ((name, arguments),) = calls  # the call as far as it got, not a whole one
    assert name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)

    r = _responses(oai, stream, cut)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert not [o for o in r.output if o.type == "function_call" and o.status == "completed"]
    assert "<tool_call>" not in r.output_text

    m = _messages(ant, stream, cut)
    assert m.stop_reason == "max_tokens"
    assert all("<tool_call>" not in b.text for b in m.content if b.type == "text")
