"""/v1/responses (official openai SDK) on a live server, and all three APIs batched together.

The tiny Hermes-template model never calls a tool by itself: forced tool choices run decoding
under the call grammar, so every call here is valid by construction. Greedy answers are
compared with /v1/chat/completions on the same conversation: the adapters share its path.
(/v1/messages: test_messages_api.py.)
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from llm_server.api.openai.responses.store import ResponseStore
from tests.api.helpers import GREEDY, WEATHER_SCHEMA, chat_once

FN_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
ANT_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}
MAX = 80


# -- Responses ------------------------------------------------------------------------------


def test_responses_create_equals_chat(oai):
    choice, usage = chat_once(oai, "Name a city.", 10, system="Be brief.")
    r = oai.responses.create(
        model="default",
        instructions="Be brief.",
        input="Name a city.",
        max_output_tokens=10,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant"
    assert r.output_text == choice.message.content
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_responses_stream_events_in_order(oai):
    """(A JSON-schema answer, so that the random model finishes before its token limit.)"""
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA, "strict": True}}
    kw = dict(model="default", input="Say hi.", text=fmt, max_output_tokens=MAX, temperature=0)
    whole = oai.responses.create(**kw)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), WEATHER_SCHEMA)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[:4] == [*head, "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done"]
    assert types[-4:] == [*tail, "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.id == events[0].response.id
    stored = oai.responses.retrieve(final.id)  # a streamed response is stored as completed
    assert stored.status == "completed" and stored.output_text == whole.output_text
    assert [o.id for o in stored.output] == [o.id for o in final.output]


def test_responses_function_call_round_trip(oai):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = oai.responses.create(
        model="default",
        input=ask,
        tools=[FN_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=MAX,
        temperature=0,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}
    # continued from the store ...
    chained = oai.responses.create(
        model="default",
        previous_response_id=first.id,
        input=[result],
        tools=[FN_TOOL],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    # ... and with the whole history sent back as items: the same prompt, the same answer
    history = [*ask, call.model_dump(exclude_none=True), result]
    explicit = oai.responses.create(
        model="default",
        input=history,
        tools=[FN_TOOL],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == explicit.output_text
    assert chained.usage.input_tokens_details.cached_tokens > 0  # the turn's KV was reused


def test_responses_streamed_call(oai):
    kw = dict(
        model="default",
        input="Weather?",
        tools=[FN_TOOL],
        tool_choice="required",
        max_output_tokens=MAX,
        temperature=0,
    )
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.output_text.delta" not in types
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 1 and "".join(pieces) == done.arguments
    (call,) = final.output
    (expected,) = whole.output
    assert (call.name, call.arguments) == (expected.name, expected.arguments)


def test_stored_responses_retrieve_delete(oai):
    r = oai.responses.create(model="default", input="Hi", max_output_tokens=3, temperature=0)
    got = oai.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    oai.responses.delete(r.id)
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.status_code == 404 and r.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="default", input="Hi", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(
        model="default", input="Hi", max_output_tokens=2, temperature=0, store=False
    )
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for rid in ("a", "b"):
        assert store.put({"id": rid}, ())
    assert store.get("a") is not None  # a is now more recent than b
    store.put({"id": "c"}, ())
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    big = {"id": "d", "pad": "x" * 6_000}
    assert store.put(big, ())
    assert store.bytes <= 10_000 and store.get("d") is not None
    assert not store.put({"id": "e", "pad": "x" * 20_000}, ())  # alone over the bound
    assert store.get("e") is None


@pytest.mark.parametrize(
    ("path", "field", "value", "param"),
    [
        ("/v1/responses", "service_tier", "turbo", "service_tier"),
        ("/v1/responses", "text", {"verbosity": "loud"}, "text.verbosity"),
        ("/v1/responses", "client_metadata", ["x"], "client_metadata"),
        ("/v1/responses", "user", 7, "user"),
        ("/v1/responses", "truncation", "auto", "truncation"),
        ("/v1/responses", "top_logprobs", 3, "top_logprobs"),
        ("/v1/messages", "service_tier", "priority", "service_tier"),
        ("/v1/messages", "metadata", {"user_id": "u", "tag": "x"}, "metadata.tag"),
        ("/v1/messages", "metadata", {"user_id": 5}, "metadata.user_id"),
    ],
)
def test_unsupported_field_values_are_refused(hermes_server, path, field, value, param):
    body = {"model": "default", "max_output_tokens": 2, "input": "Hi", field: value}
    if path == "/v1/messages":
        body = {
            "model": "default",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        body[field] = value
    r = httpx.post(hermes_server.url + path, json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.get("param", param) == param and f"'{param}'" in error["message"]


def test_accepted_no_op_field_values(hermes_server):
    ask = [{"role": "user", "content": "Hi"}]
    msg = {"model": "default", "max_tokens": 2, "messages": ask}
    extra = {"service_tier": "standard_only", "metadata": {"user_id": "u-1"}}
    r = httpx.post(hermes_server.url + "/v1/messages", json={**msg, **extra}, timeout=60)
    assert r.status_code == 200
    resp = {"model": "default", "max_output_tokens": 2, "input": "Hi", "user": "u-1"}
    r = httpx.post(hermes_server.url + "/v1/responses", json={**resp, "service_tier": "auto"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["user"] == "u-1"
    # Codex's fields, accepted without effect (README): the tier that ran it is 'default'
    codex = {"service_tier": "priority", "text": {"verbosity": "low"}, "prompt_cache_key": "k",
             "client_metadata": {"turn_id": "t"}, "include": ["reasoning.encrypted_content"]}  # fmt: skip
    r = httpx.post(hermes_server.url + "/v1/responses", json={**resp, **codex}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["service_tier"] == "default"
    assert body["text"]["verbosity"] == "low" and body["prompt_cache_key"] == "k"


# -- one engine: all three APIs batched together ----------------------------------------------


def _three(oai, ant, i: int) -> tuple[str, str, str]:
    text = f"Tell me about {i}."
    chat = chat_once(oai, text, 8)[0].message.content
    resp = oai.responses.create(model="default", input=text, max_output_tokens=8, temperature=0)
    msg = ant.messages.create(
        model="default",
        messages=[{"role": "user", "content": text}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    return chat, resp.output_text, msg.content[0].text


def test_three_apis_batched_equal_alone(oai, ant):
    alone = [_three(oai, ant, i) for i in range(2)]
    for chat, resp, msg in alone:
        assert chat == resp == msg
    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(chat_once, oai, f"Tell me about {i}.", 8) for i in range(2)]
        jobs += [
            pool.submit(
                oai.responses.create,
                model="default",
                input=f"Tell me about {i}.",
                max_output_tokens=8,
                temperature=0,
            )
            for i in range(2)
        ]
        jobs += [
            pool.submit(
                ant.messages.create,
                model="default",
                messages=[{"role": "user", "content": f"Tell me about {i}."}],
                max_tokens=8,
                extra_body=GREEDY,
            )
            for i in range(2)
        ]
        done = [j.result() for j in jobs]
    assert [d[0].message.content for d in done[:2]] == [a[0] for a in alone]
    assert [d.output_text for d in done[2:4]] == [a[1] for a in alone]
    assert [d.content[0].text for d in done[4:]] == [a[2] for a in alone]
