"""Tools on a model whose chat template has no call syntax: the embedded SmolLM2 gets the generic
format on all three APIs (official SDKs), named and required calls valid against their schemas,
streamed and not; under auto a call the model starts is parsed and held to its schema."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from llm_server.api.chat import plan as chat_plan
from llm_server.api.shared.schemas import parse_messages
from llm_server.api.shared.tool_fields import parse_tools
from tests.api.helpers import WEATHER_SCHEMA, ForcedPrefix

pytestmark = pytest.mark.slow

TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
DESCRIPTIONS = {"get_weather": "Weather forecast for a city", "get_time": "The time in a zone"}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
    for n, s in SCHEMAS.items()
]
RESP_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ANT_TOOLS = [
    {"name": n, "description": DESCRIPTIONS[n], "input_schema": s} for n, s in SCHEMAS.items()
]
QUESTION = "What is the weather in Paris for the next 3 days?"
MAX = 120


@pytest.fixture(scope="module")
def smol(default_model_path):
    from llm_server.testing.live import serving

    with serving(default_model_path, concurrent=2) as srv:
        assert srv.service.syntax.tool_parser == "generic"
        yield srv


@pytest.fixture(scope="module")
def oai(smol) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(smol) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0)


def _valid(name: str, arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def _chat_calls(oai, choice, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    kw = dict(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        tool_choice=choice,
        max_tokens=MAX,
        temperature=0,
    )
    if not stream:
        c = oai.chat.completions.create(**kw).choices[0]
        assert c.message.content is None
        return c.finish_reason, [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls
        ]
    calls, finish = [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        assert not delta.content  # no call markup as content
        for d in delta.tool_calls or ():
            if d.function.name:
                calls.append((d.function.name, ""))
            if d.function.arguments:
                calls[d.index] = (calls[d.index][0], calls[d.index][1] + d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return finish, calls


@pytest.mark.parametrize("stream", [False, True])
def test_chat_named_and_required_calls(oai, stream):
    finish, calls = _chat_calls(
        oai, {"type": "function", "function": {"name": "get_weather"}}, stream
    )
    assert finish == "tool_calls" and [n for n, _ in calls] == ["get_weather"]
    _valid(*calls[0])
    finish, calls = _chat_calls(oai, "required", stream)
    assert finish == "tool_calls" and calls
    for call in calls:
        _valid(*call)


def _responses(oai, choice, stream: bool):
    kw = dict(
        model="default",
        input=QUESTION,
        tools=RESP_TOOLS,
        tool_choice=choice,
        max_output_tokens=MAX,
        temperature=0,
    )
    if not stream:
        return oai.responses.create(**kw)
    with oai.responses.stream(**kw) as s:
        return s.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_named_and_required_calls(oai, stream):
    for choice in ({"type": "function", "name": "get_time"}, "required"):
        r = _responses(oai, choice, stream)
        assert r.status == "completed"
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and all(c.status == "completed" for c in calls)
        if choice != "required":
            assert [c.name for c in calls] == ["get_time"]
        for c in calls:
            _valid(c.name, c.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_named_and_required_calls(ant, stream):
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        kw = dict(
            model="default",
            messages=[{"role": "user", "content": QUESTION}],
            tools=ANT_TOOLS,
            tool_choice=choice,
            max_tokens=MAX,
            extra_body={"temperature": 0},
        )
        if stream:
            with ant.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ant.messages.create(**kw)
        assert m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and all("<tool_call>" not in b.text for b in m.content if b.type == "text")
        if choice["type"] == "tool":
            assert [u.name for u in uses] == ["get_weather"]
        for u in uses:
            _valid(u.name, u.input)


def test_auto_parses_the_call_the_model_starts(oai, smol, monkeypatch):
    """SmolLM2-135M answers in prose under auto; once `<tool_call>` is written (forced here),
    the lazy grammar holds the call to its schema and the parser returns it as a call."""
    prefix = smol.service.tokenizer.encode("<tool_call>", add_special_tokens=False)
    real = chat_plan._constraint

    async def with_prefix(service, chat, thinking_open):
        return ForcedPrefix(prefix, await real(service, chat, thinking_open))

    monkeypatch.setattr(chat_plan, "_constraint", with_prefix)
    c = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        max_tokens=MAX,
        temperature=0,
    ).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    for t in c.message.tool_calls:
        _valid(t.function.name, t.function.arguments)


def test_a_tool_result_reaches_the_next_turn(oai, smol):
    """The call and its result are written into the prompt as text for the plain template."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = oai.chat.completions.create(
        model="default", messages=messages, tools=CHAT_TOOLS, max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shown = chat_plan.render_prompt(
        smol.service,
        list(parse_messages({"messages": messages})),
        parse_tools({"tools": CHAT_TOOLS}),
    )
    assert r.usage.prompt_tokens == len(shown)
    prompt = smol.service.tokenizer.decode(shown, skip_special_tokens=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in prompt
    assert prompt.count("# Tools") == 1  # the tools block, once, in the system turn
