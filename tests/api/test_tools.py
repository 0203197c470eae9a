"""Tool calling with the official openai SDK against a live server (tiny Hermes-template model).

The random tiny model never calls a tool on its own: `tool_choice` required/named runs decoding
under the llguidance call grammar, so every call here is valid by construction.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from llm_server.api.chat import plan as chat_plan
from tests.api.helpers import WEATHER_SCHEMA, ForcedPrefix

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 120


@pytest.fixture(scope="module")
def client(hermes_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0)


def _schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _required_call(client: openai.OpenAI, messages: list[dict], **kw):
    """A greedy chat completion that must call one of TOOLS."""
    return client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX,
        temperature=0,
        **kw,
    )


def test_required_call_is_valid_against_the_schema(client):
    r = _required_call(client, ASK, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_carry_their_own_valid_call(client, stream):
    """n > 1 with a forced call: every choice runs under its own grammar state and is parsed
    on its own (streamed, each choice's deltas carry its index)."""
    kwargs = dict(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX,
        temperature=1.0,
        seed=7,
        n=3,
        parallel_tool_calls=False,
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        calls = {c.index: c.message.tool_calls for c in r.choices}
        assert sorted(calls) == [0, 1, 2]
        assert all(c.finish_reason == "tool_calls" for c in r.choices)
        args = {i: [(t.function.name, t.function.arguments) for t in calls[i]] for i in calls}
    else:
        args = {0: [], 1: [], 2: []}
        finish = {}
        for ev in client.chat.completions.create(stream=True, **kwargs):
            for choice in ev.choices:
                for d in choice.delta.tool_calls or []:
                    if d.function.name:
                        args[choice.index].append((d.function.name, ""))
                    if d.function.arguments:
                        name, text = args[choice.index][d.index]
                        args[choice.index][d.index] = (name, text + d.function.arguments)
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for i in range(3):
        assert args[i], f"choice {i} made no call"
        for name, arguments in args[i]:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


def test_named_call_streams_the_same_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="default", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=MAX, temperature=0
    )
    full = client.chat.completions.create(**kw)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas)  # no raw markup in content
    parts = [tc for d in deltas for tc in d.tool_calls or ()]
    first = parts[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    assert len(parts) > 3  # the arguments arrive in fragments
    assert "".join(p.function.arguments for p in parts) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=3)


def test_parse_with_a_pydantic_tool(client):
    r = client.chat.completions.parse(
        model="default",
        messages=ASK,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice="required",
        max_tokens=MAX,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "Forecast"
    assert isinstance(call.function.parsed_arguments, Forecast)
    assert 1 <= call.function.parsed_arguments.days <= 3


def test_three_turn_agent_loop(client, hermes_server):
    messages = list(ASK)
    first = _required_call(client, messages)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'})
    final = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    # the history (the call and the tool result) reached the template
    tok = hermes_server.service.tokenizer
    history = [
        {"role": "user", "content": ASK[0]["content"]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in msg.tool_calls
            ],
        },
        {"role": "tool", "content": '{"temp_c": 18}'},
    ]
    # the template is shown each function's name, description and parameters
    shown = [
        {"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
        for t in TOOLS
    ]
    prompt = tok.render_chat(history, shown)
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in prompt
    assert msg.tool_calls[0].function.name in prompt
    assert final.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_auto_holds_a_started_call_to_the_schema(client, hermes_server, monkeypatch):
    """Under auto the lazy grammar leaves text free; once the model writes <tool_call> (forced
    here, the random model never would), the call is constrained like a forced one."""
    prefix = hermes_server.service.tokenizer.encode("Let me check.\n<tool_call>", False)
    real = chat_plan._constraint

    async def with_prefix(service, chat, thinking_open):
        return ForcedPrefix(prefix, await real(service, chat, thinking_open))

    monkeypatch.setattr(chat_plan, "_constraint", with_prefix)
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=MAX, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def _plain(client, i: int):
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"Count to {i}."}],
        max_tokens=12,
        temperature=0,
    )
    return r.choices[0].message.content, r.usage.completion_tokens


def _call(client, i: int):
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"Weather in city {i}?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX,
        temperature=0,
    )
    return r.choices[0]


def test_tool_rows_batched_beside_plain_rows(client, hermes_server):
    alone = [_plain(client, i) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(_call, client, i) for i in range(4)]
        plain = [pool.submit(_plain, client, i) for i in range(4)]
        calls, plain = [f.result() for f in calls], [f.result() for f in plain]
    assert plain == alone  # greedy rows are token-identical beside constrained rows (S10)
    for choice in calls:
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(
            json.loads(choice.message.tool_calls[0].function.arguments), WEATHER_SCHEMA
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=ASK, max_tokens=2, extra_body=extra
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == param


LOOKBEHIND = {
    "type": "function",
    "function": {
        "name": "odd",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
        },
    },
}


def test_a_schema_the_grammar_cannot_take(client):
    """Refused where the call must be valid (required, strict); parsed only under auto."""
    strict = {**LOOKBEHIND, "function": {**LOOKBEHIND["function"], "strict": True}}
    for tools, choice in (([LOOKBEHIND], "required"), ([strict], "auto")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="default", messages=ASK, tools=tools, tool_choice=choice, max_tokens=2
            )
        assert err.value.body["param"] == "tools"
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=[LOOKBEHIND], max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_history_call_is_400(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{not json"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=messages, max_tokens=2)
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_template_without_tool_syntax_gets_the_generic_format(server):
    """The plain ChatML template shows no call syntax: tools are described in a system block
    and a forced call comes back as a call (was a 400 naming `tools`)."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=MAX, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    plain = c.chat.completions.create(model="default", messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools block is in the prompt
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": named}
    counted = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]
    assert counted == r.usage.prompt_tokens  # /tokenize shows the same block
    r = c.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # 'none': nothing to call


def test_tokenize_counts_the_prompt_a_tools_request_sends(client, hermes_server):
    body = {"messages": ASK, "tools": TOOLS}
    counted = httpx.post(hermes_server.url + "/tokenize", json=body, timeout=30).json()["count"]
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert counted == r.usage.prompt_tokens
    plain = httpx.post(hermes_server.url + "/tokenize", json={"messages": ASK}, timeout=30)
    assert plain.json()["count"] < counted  # the tools are in the prompt
