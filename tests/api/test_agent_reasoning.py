"""Thinking models on /v1/responses (reasoning items) and /v1/messages (thinking blocks).

As in test_reasoning.py, a scripted constraint forces the random tiny model to think and
answer (`<think>` is opened by the Qwen3-style template).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from llm_server.api.anthropic.input import parse_messages_request
from llm_server.api.openai.responses.input import parse_responses
from tests.api.test_reasoning import ANSWER, ASK, THOUGHT, _script

GREEDY = {"temperature": 0}


@pytest.fixture
def oai(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def ant(think_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=think_server.url, api_key="unused", max_retries=0)


def test_reasoning_item_then_message(oai, think_server, monkeypatch):
    thought, _ = _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    r = oai.responses.create(
        model="default", input=ASK, max_output_tokens=64, reasoning={"summary": "auto"}
    )
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert [(s.type, s.text) for s in reasoning.summary] == [("summary_text", THOUGHT)]
    assert r.output_text == ANSWER and r.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens == len(thought)


def test_streamed_reasoning_events(oai, think_server, monkeypatch):
    _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    with oai.responses.stream(model="default", input=ASK, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, answer) == (THOUGHT, ANSWER)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].summary == []  # no summary asked for
    assert final.output_text == ANSWER


def test_reasoning_items_reach_the_next_turn(think_server):
    """A reasoning item sent back in `input` becomes the next assistant message's
    reasoning_content (which thinking templates show inside a tool loop)."""
    body = {
        "input": [
            *ASK,
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "function_call", "call_id": "c1", "name": "greet", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ]
    }  # fmt: skip
    chat = parse_responses(body, think_server.service).chat
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1]["reasoning_content"] == THOUGHT
    assert chat.messages[1]["tool_calls"][0]["id"] == "c1"


def test_thinking_blocks(ant, think_server, monkeypatch):
    thought, _ = _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    kw = dict(
        model="default",
        messages=ASK,
        max_tokens=512,  # prompt + max_tokens fit the 1,024 positions (no cap on /v1/messages)
        thinking={"type": "enabled", "budget_tokens": 256},
        extra_body=GREEDY,
    )
    m = ant.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (THOUGHT, ANSWER)
    assert m.stop_reason == "end_turn"
    _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    with ant.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (THOUGHT, ANSWER)


def test_thinking_disabled_closes_the_think_block(ant, think_server, monkeypatch):
    _script(monkeypatch, think_server, ANSWER)
    m = ant.messages.create(
        model="default", messages=ASK, max_tokens=16, thinking={"type": "disabled"}
    )
    assert [(b.type, b.text) for b in m.content] == [("text", ANSWER)]
    tok = think_server.service.tokenizer
    closed = tok.render_chat(ASK, None, {"enable_thinking": False})
    counted = ant.messages.count_tokens(
        model="default", messages=ASK, thinking={"type": "disabled"}
    )
    assert counted.input_tokens == len(tok.encode(closed, add_special_tokens=False))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


def test_thinking_budget_forces_the_end_of_thinking(ant, think_server):
    """The random model never closes </think>: with no budget ('adaptive') the whole answer is
    thinking; with budget_tokens 5 the thinking stops after its first 5 tokens (the same
    greedy tokens) and the answer follows."""
    kw = dict(model="default", messages=ASK, max_tokens=24, extra_body=GREEDY)
    free = ant.messages.create(thinking={"type": "adaptive"}, **kw)
    assert [b.type for b in free.content] == ["thinking"] and free.stop_reason == "max_tokens"
    capped = ant.messages.create(thinking={"type": "enabled", "budget_tokens": 5}, **kw)
    assert [b.type for b in capped.content] == ["thinking", "text"]
    thought, whole = capped.content[0].thinking, free.content[0].thinking
    assert thought and whole.startswith(thought) and len(thought) < len(whole)
    assert capped.content[1].text and capped.stop_reason == "max_tokens"
    with ant.messages.stream(thinking={"type": "enabled", "budget_tokens": 5}, **kw) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in capped.content]


def test_thinking_of_earlier_turns_reaches_the_template_request(oai, think_server, monkeypatch):
    """Stored responses keep their reasoning; Messages history keeps thinking blocks: both come
    back as the assistant message's reasoning_content."""
    _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    first = oai.responses.create(model="default", input=ASK, max_output_tokens=64)
    stored = think_server.app.state.responses.get(first.id)
    assert stored.messages[-1] == {
        "role": "assistant",
        "content": ANSWER,
        "reasoning_content": THOUGHT,
    }
    chat = parse_responses({"input": "And?"}, think_server.service, stored.messages).chat
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user"]
    assert chat.messages[1]["reasoning_content"] == THOUGHT
    history = {
        "max_tokens": 8,
        "system": "Be kind.",
        "messages": [
            *ASK,
            {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT,
             "signature": ""}, {"type": "text", "text": ANSWER}]},
            {"role": "user", "content": "And?"},
        ],
    }  # fmt: skip
    chat = parse_messages_request(history, think_server.service)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.messages[2] == {
        "role": "assistant",
        "content": ANSWER,
        "reasoning_content": THOUGHT,
    }


def test_reasoning_effort_none_turns_thinking_off(oai, think_server, monkeypatch):
    _script(monkeypatch, think_server, ANSWER)
    r = oai.responses.create(
        model="default", input=ASK, max_output_tokens=16, reasoning={"effort": "none"}
    )
    assert [o.type for o in r.output] == ["message"] and r.output_text == ANSWER
    tok = think_server.service.tokenizer
    closed = tok.render_chat(ASK, None, {"enable_thinking": False})
    assert r.usage.input_tokens == len(tok.encode(closed, add_special_tokens=False))
