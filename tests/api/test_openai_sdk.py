"""The official openai SDK against a live server: responses parse and match the tokenizer."""

from __future__ import annotations

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_len(server, messages) -> int:
    return len(server.service.tokenizer.apply_chat_template(messages))


def test_chat_non_streaming_and_streaming_agree(client, server):
    model = server.state.model_id
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert isinstance(full, ChatCompletion)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert full.model == model and full.system_fingerprint == server.service.fingerprint
    assert full.usage.prompt_tokens == _prompt_len(server, MESSAGES)
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streaming changes nothing
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [choice.finish_reason]
    streamed = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
        full.usage.total_tokens,
    )
    # the second, identical prompt reuses the first one's KV from the prefix cache
    assert streamed.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_text_parts_equal_string_content(client, server):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
        }
    ]
    a = client.chat.completions.create(model="default", messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (
        b.usage.prompt_tokens,
        b.usage.completion_tokens,
    )


def test_chat_stop_cuts_output(client):
    base = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=16, temperature=0
    )
    text = base.choices[0].message.content
    assert len(text) > 6, "the tiny model should say something"
    stop = text[4:6]
    cut = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop, "\x00never"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert stop not in cut.choices[0].message.content


def test_chat_logprobs(client, server):
    resp = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    n = resp.usage.completion_tokens
    # EOS ends the answer and carries no logprob entry.
    assert len(content) == (n if choice.finish_reason == "length" else n - 1)
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the best alternative.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


def test_chat_seed_reproducible(client):
    kw = dict(model="default", messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_string_prompt(client, server):
    prompt = "The capital of France is"
    resp = client.completions.create(model="default", prompt=prompt, max_tokens=5, temperature=0)
    assert isinstance(resp, Completion)
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(server.service.tokenizer.encode(prompt))
    echo = client.completions.create(
        model="default", prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echo.choices[0].text == prompt + resp.choices[0].text


def test_completions_report_cached_tokens(client, server):
    """The SDK's `usage.prompt_tokens_details.cached_tokens` on /v1/completions: none the
    first time, all of the prompt but its last token when it is sent again."""
    prompt = "Write a short note about the river and the old mill. " * 6
    first = client.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert again.choices[0].text == first.choices[0].text


def test_completions_token_id_prompts(client, server):
    tok = server.service.tokenizer
    ids = [
        tok.encode("hello world", add_special_tokens=False),
        tok.encode("colour", add_special_tokens=False),
    ]
    resp = client.completions.create(
        model="default", prompt=ids, max_tokens=4, temperature=0, logprobs=2
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # no BOS added
    for c in resp.choices:
        n = len(c.logprobs.tokens)
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) == n
        assert c.logprobs.text_offset[0] == 0
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    single = client.completions.create(model="default", prompt=ids[0], max_tokens=4, temperature=0)
    assert single.choices[0].text == resp.choices[0].text


def test_completions_streaming(client):
    prompts = ["one", "two"]
    full = client.completions.create(model="default", prompt=prompts, max_tokens=4, temperature=0)
    chunks = list(
        client.completions.create(
            model="default",
            prompt=prompts,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in full.choices]
    assert chunks[-1].usage == full.usage


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.state.model_id]
