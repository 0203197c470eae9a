"""/v1/messages (official anthropic SDK) on a live server.

As in test_agent_apis.py: forced tool choices run decoding under the call grammar, and greedy
answers are compared with /v1/chat/completions on the same conversation.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from llm_server.testing.live import LiveServer
from tests.api.helpers import GREEDY, WEATHER_SCHEMA, chat_once

FN_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
ANT_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}
MAX = 80
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


# -- Messages -------------------------------------------------------------------------------


def test_messages_create_equals_chat(ant, oai):
    choice, usage = chat_once(oai, "Name a city.", 10, system="Be brief.")
    m = ant.messages.create(
        model="default",
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "Name a city."}],
        max_tokens=10,
        extra_body=GREEDY,
    )
    assert m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == choice.message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.output_tokens == usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert m.stop_reason == expected and m.stop_sequence is None
    counted = ant.messages.count_tokens(
        model="default",
        system="Be brief.",
        messages=[{"role": "user", "content": "Name a city."}],
    )
    assert counted.input_tokens == usage.prompt_tokens


def test_messages_stop_sequence(ant):
    kw = dict(model="default", messages=[{"role": "user", "content": "Count."}], extra_body=GREEDY)
    text = ant.messages.create(max_tokens=12, **kw).content[0].text
    stop = text[4:6]
    m = ant.messages.create(max_tokens=12, stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.find(stop)]


def test_messages_stream_accumulates(ant, hermes_server):
    kw = dict(
        model="default",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in RAW_EVENTS]  # the SDK adds its own "text" events
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    body = {**kw["extra_body"], **{k: v for k, v in kw.items() if k != "extra_body"}}
    sse = httpx.post(hermes_server.url + "/v1/messages", json={**body, "stream": True}).text
    names = [line[len("event: ") :] for line in sse.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]  # what the SDK skips
    assert 1 < names.count("content_block_delta") <= whole.usage.output_tokens
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_messages_tool_use_round_trip(ant):
    ask = {"role": "user", "content": "Weather in Paris?"}
    kw = dict(model="default", tools=[ANT_TOOL], max_tokens=MAX, extra_body=GREEDY)
    choice = {"type": "tool", "name": "get_weather"}
    first = ant.messages.create(messages=[ask], tool_choice=choice, **kw)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with ant.messages.stream(messages=[ask], tool_choice=choice, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    follow = [
        ask,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}],
        },
    ]
    second = ant.messages.create(messages=follow, tool_choice={"type": "none"}, **kw)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_messages_errors_in_anthropic_format(ant, hermes_server):
    ask = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(model="default", messages=ask, max_tokens=4, thinking={
            "type": "enabled", "budget_tokens": 2048})  # fmt: skip
    assert err.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "thinking.budget_tokens must be below max_tokens",
        },
    }
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="claude-x", messages=ask, max_tokens=4)
    with LiveServer(hermes_server.service, api_key="sekrit") as keyed:
        good = anthropic.Anthropic(base_url=keyed.url, api_key="sekrit", max_retries=0)
        assert good.messages.create(model="default", messages=ask, max_tokens=2).content
        bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(model="default", messages=ask, max_tokens=2)
        assert err.value.body["error"]["type"] == "authentication_error"
        bearer = httpx.post(
            keyed.url + "/v1/messages",
            json={"messages": ask, "max_tokens": 2},
            headers={"Authorization": "Bearer sekrit", "anthropic-version": "2023-06-01"},
            timeout=60,
        )
        assert bearer.status_code == 200
