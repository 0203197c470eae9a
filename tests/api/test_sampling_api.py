"""The sampling set through the official openai SDK on a live tiny server with 4 rows:
n choices, seeds that hold inside a full batch, logit_bias, top_k, atomic admission."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from llm_server.decoding import SamplingParams
from llm_server.scheduler import QueueFull
from tests.scheduler.helpers import make_request, start_scheduler

ROWS = 4


@pytest.fixture(scope="module")
def server(tiny_model_path: Path):
    from llm_server.testing.live import serving

    with serving(tiny_model_path, concurrent=ROWS) as srv:
        yield srv


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_n3_returns_three_indexed_choices_and_summed_usage(client, server):
    messages = _user("n three: tell me a story about a lighthouse keeper")
    prompt_len = len(server.service.tokenizer.apply_chat_template(messages))
    before = server.service.prefix_cache_stats()
    resp = client.chat.completions.create(
        model="default", messages=messages, n=3, max_tokens=6, temperature=1.0, seed=11
    )
    after = server.service.prefix_cache_stats()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == prompt_len  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * 6
    # seeds 11, 12, 13: three different answers, each of which repeats
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3
    again = client.chat.completions.create(
        model="default", messages=messages, n=3, max_tokens=6, temperature=1.0, seed=11
    )
    assert [c.message.content for c in again.choices] == texts
    # choices 1 and 2 took the prompt's KV from choice 0 (all but the last prompt token);
    # choice 0 itself only what the cache held before (its cached_tokens in usage)
    first = resp.usage.prompt_tokens_details.cached_tokens
    assert after.hits - before.hits == 2 + (first > 0)
    assert after.hit_tokens - before.hit_tokens == first + 2 * (prompt_len - 1)


def test_chat_stream_n_interleaves_choices_that_match_the_full_answer(client):
    kw = {
        "model": "default",
        "messages": _user("stream three"),
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
    }
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in full.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_completions_n_orders_choices_prompt_by_prompt(client):
    resp = client.completions.create(
        model="default", prompt=["alpha beta", "gamma delta"], n=2, max_tokens=5, temperature=0
    )
    alone = [
        client.completions.create(model="default", prompt=p, max_tokens=5, temperature=0)
        for p in ("alpha beta", "gamma delta")
    ]
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    expected = [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert [c.text for c in resp.choices] == expected
    assert resp.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert resp.usage.completion_tokens == 4 * 5


def test_seeded_request_same_alone_and_in_a_full_batch(client, server):
    kw = {
        "model": "default",
        "messages": _user("seeded: pick some words"),
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 1234,
        "extra_body": {"top_k": 50, "min_p": 0.01},
    }
    alone = client.chat.completions.create(**kw).choices[0].message.content
    sched = server.service.scheduler
    no_eos = {str(t): -100 for t in server.service.tokenizer.eos_token_ids}
    stop = threading.Event()
    streamed: dict[int, int] = {}

    def other(i: int) -> None:
        """Sample until told to stop (EOS banned, room for ~1000 tokens): a busy row."""
        stream = client.completions.create(
            model="default",
            prompt=f"other request {i} " * 3,
            max_tokens=1000,
            temperature=0.9,
            logit_bias=no_eos,
            stream=True,
        )
        streamed[i] = 0
        for _ in stream:
            streamed[i] += 1
            if stop.is_set():
                break
        stream.close()  # cancels the rest

    threads = [threading.Thread(target=other, args=(i,)) for i in range(ROWS - 1)]
    sched.step_trace = []
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sched.stats().rows_busy < ROWS - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        seeded = client.chat.completions.create(**kw).choices[0].message.content
        stop.set()
        for t in threads:
            t.join(60)
        trace = sched.step_trace
    finally:
        sched.step_trace = None
        stop.set()
    assert seeded == alone
    assert max(len(step) for step in trace) == ROWS  # it shared decode steps with 3 others
    assert len(streamed) == ROWS - 1


def test_logit_bias_forces_and_bans_tokens(client, server):
    tok = server.service.tokenizer
    forced = tok.encode("the", add_special_tokens=False)[0]
    resp = client.completions.create(
        model="default",
        prompt="anything at all",
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logprobs=0,
        logit_bias={str(forced): 100},
    )
    assert resp.choices[0].logprobs.tokens == tok.token_strings([forced]) * 5
    greedy = client.completions.create(
        model="default", prompt="anything at all", max_tokens=1, temperature=0, logprobs=0
    )
    first = greedy.choices[0].logprobs.tokens[0]
    first_id = next(i for i in range(tok.vocab_size) if tok.token_strings([i])[0] == first)
    banned = client.completions.create(
        model="default",
        prompt="anything at all",
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={str(first_id): -100},
    )
    assert banned.choices[0].logprobs.tokens[0] != first


def test_top_k_one_through_the_api_is_greedy(client):
    kw = {"model": "default", "messages": _user("top k one"), "max_tokens": 8}
    greedy = client.chat.completions.create(**kw, temperature=0)
    top1 = client.chat.completions.create(**kw, temperature=1.5, seed=9, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_penalties_reach_the_sampler(client, server):
    """A penalty on repeated tokens changes what a greedy request repeats (2.0 is strong)."""
    kw = {"model": "default", "prompt": "a a a a a a", "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kw, logprobs=0).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain)  # greedy on this tiny model repeats itself
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        tokens = client.completions.create(**kw, logprobs=0, **extra).choices[0].logprobs.tokens
        assert tokens != plain, extra


def test_n_choices_are_admitted_all_or_none(tiny_model_path):
    sched = start_scheduler(tiny_model_path, 1, max_queued=1)
    try:
        tok = server_tokenizer(tiny_model_path)
        long_req, long_out = make_request(tok, [5, 6, 7, 8], 400, ignore_eos=True)
        sched.submit(long_req)
        pair = [make_request(tok, [9, 10, 11], 4)[0] for _ in range(2)]
        with pytest.raises(QueueFull):
            sched.submit_all(pair)  # one slot left, two asked: neither is queued
        stats = sched.stats()
        assert stats.rows_busy + stats.queued == 1  # only the long request, running or queued
        single, single_out = make_request(tok, [9, 10, 11], 4)
        sched.submit_all([single])  # the free slot is still there
        long_req.cancel()
        assert single_out.done.wait(60) and long_out.done.wait(60)
    finally:
        sched.close(10)


def server_tokenizer(model: Path):
    from llm_server.tokenizer import Tokenizer

    return Tokenizer(model)


def test_seeded_choices_use_consecutive_seeds():
    from llm_server.api.shared.handling import choice_params

    p = SamplingParams(max_tokens=4, seed=40)
    assert [choice_params(p, i).seed for i in range(3)] == [40, 41, 42]
    assert choice_params(SamplingParams(max_tokens=4), 2).seed is None


def test_n_choices_each_follow_their_own_grammar_over_the_bias(client, server):
    """Each of n constrained choices has its own grammar state; a +100 bias on a token the
    grammar forbids does not get past the mask."""
    word = server.service.tokenizer.encode("the", add_special_tokens=False)[0]
    schema = {"type": "integer", "minimum": 0, "maximum": 999}
    resp = client.chat.completions.create(
        model="default",
        messages=_user("a number please"),
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=21,
        logit_bias={str(word): 100},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": True},
        },
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert c.finish_reason == "stop"
        assert 0 <= int(c.message.content) <= 999, c.message.content
