"""Reasoning output: a thinking template's `<think>` text goes to reasoning_content/reasoning.

The random tiny model never closes `</think>` by itself, so a scripted logits constraint (in the
place of the request's grammar) forces the text token by token through the real engine.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

from llm_server.api.chat import plan as chat_plan
from llm_server.decoding import LogitsConstraint
from tests.api.helpers import ForcedPrefix

THOUGHT, ANSWER = "The user greets me.", "Hello there."
ASK = [{"role": "user", "content": "Hi!"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "greet",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}


class Scripted(LogitsConstraint):
    """Allows exactly the next token of a fixed sequence (then EOS)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.i = ids, 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[self.ids[self.i]] = 0.0
        return out

    def advance(self, token: int) -> bool:
        self.i += 1
        return False


@pytest.fixture
def client(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0)


def _script(monkeypatch, server, *texts: str) -> list[list[int]]:
    tok = server.service.tokenizer
    parts = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids = [i for p in parts for i in p] + [min(tok.eos_token_ids)]

    async def scripted(service, chat, thinking_open):
        return Scripted(ids)

    monkeypatch.setattr(chat_plan, "_constraint", scripted)
    return parts


def test_thinking_is_split_from_the_answer(client, think_server, monkeypatch):
    thought, _ = _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=64)
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"], msg.model_extra["reasoning"]) == (
        ANSWER,
        THOUGHT,
        THOUGHT,
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == len(thought)


def test_streamed_thinking_arrives_as_reasoning_deltas(client, think_server, monkeypatch):
    thought, _ = _script(monkeypatch, think_server, THOUGHT + "</think>", "\n\n" + ANSWER)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    newer = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, newer, content) == (THOUGHT, THOUGHT, ANSWER)
    # no delta carries both: the reasoning ends before the answer starts
    assert not any(d.content and d.model_extra.get("reasoning_content") for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(thought)


def test_tool_grammar_applies_after_thinking(client, think_server, monkeypatch):
    """The model thinks freely (forced here), then the tool grammar holds the call."""
    prefix = think_server.service.tokenizer.encode(THOUGHT + "</think>\n\n", False)
    real = chat_plan._constraint

    async def with_prefix(service, chat, thinking_open):
        assert thinking_open
        return ForcedPrefix(prefix, await real(service, chat, thinking_open))

    monkeypatch.setattr(chat_plan, "_constraint", with_prefix)
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert r.usage.completion_tokens_details.reasoning_tokens == len(
        think_server.service.tokenizer.encode(THOUGHT + "</think>", False)
    )


def test_enable_thinking_false_reaches_the_template(client, think_server, monkeypatch):
    _script(monkeypatch, think_server, ANSWER)
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message
    assert msg.content == ANSWER and msg.model_extra["reasoning_content"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    tok = think_server.service.tokenizer
    closed = tok.render_chat(ASK, None, {"enable_thinking": False})
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert r.usage.prompt_tokens == len(tok.encode(closed, add_special_tokens=False))
