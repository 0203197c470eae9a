"""Prompt prefix cache: same output with it on or off, bounded bytes, cached_tokens reported,
a conversation's long prefix kept over many short unrelated prompts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.kv.prefix_cache import PrefixCache, default_bound, kv_token_bytes
from llm_server.engines.mlx import executor as mlx_steps
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, start_scheduler

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny model: layers * (k, v) * kv_heads * head_dim * f32


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _run_batch(sched, tok, prompts: list[list[int]], max_tokens: int = 12):
    pairs = [make_request(tok, p, max_tokens, ignore_eos=True) for p in prompts]
    for req, _ in pairs:
        sched.submit(req)
    for _, out in pairs:
        assert out.done.wait(60)
    return [out for _, out in pairs]


def _conversations(model, tok: Tokenizer, cache_bytes: int, turns: int = 3, chats: int = 4):
    """Multi-turn chats at 4 rows: each turn resends the whole history plus the answer."""
    sched = start_scheduler(model, 4, prefix_cache_bytes=cache_bytes)
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    histories = [
        [system, {"role": "user", "content": f"question {i}: tell me about {i * 7}"}]
        for i in range(chats)
    ]
    outs_per_turn = []
    try:
        for turn in range(turns):
            prompts = [tok.apply_chat_template(h) for h in histories]
            outs = _run_batch(sched, tok, prompts)
            outs_per_turn.append(outs)
            for h, out in zip(histories, outs, strict=True):
                h.append({"role": "assistant", "content": out.text})
                h.append({"role": "user", "content": f"and then? (turn {turn})"})
        return outs_per_turn, sched.engine.prefix_cache.stats()
    finally:
        sched.close(10)


def test_multi_turn_outputs_identical_with_cache_on_and_off(tok, tiny_model_path):
    off, off_stats = _conversations(tiny_model_path, tok, 0)
    on, on_stats = _conversations(tiny_model_path, tok, 64 << 20)
    for turn_off, turn_on in zip(off, on, strict=True):
        assert [o.tokens for o in turn_on] == [o.tokens for o in turn_off]
    assert off_stats.hits == 0 and all(o.finish.cached_tokens == 0 for t in off for o in t)
    later = [o.finish.cached_tokens for t in on[1:] for o in t]
    assert all(c > 0 for c in later), later  # every follow-up turn reused its history
    assert on_stats.hit_tokens == sum(o.finish.cached_tokens for t in on for o in t)


def test_shared_system_prompt_and_same_prefix_at_once(tok, tiny_model_path):
    system = list(range(40, 190))  # 150 shared tokens
    prompts = [system + [200 + i, 201 + i, 202] for i in range(8)]
    off = start_scheduler(tiny_model_path, 4, prefix_cache_bytes=0)
    on = start_scheduler(tiny_model_path, 4, prefix_cache_bytes=64 << 20)
    try:
        ref = _run_batch(off, tok, prompts)
        # four with the same prefix at once: no cache entry yet, so the first computes the
        # prefix and the other three copy it from its row while it runs
        first = _run_batch(on, tok, prompts[:4])
        second = _run_batch(on, tok, prompts[4:])
        assert [o.tokens for o in first + second] == [o.tokens for o in ref]
        cached = [o.finish.cached_tokens for o in first]
        assert cached[0] == 0 and all(c >= 150 for c in cached[1:]), cached
        assert all(o.finish.cached_tokens >= 150 for o in second)
    finally:
        off.close(10)
        on.close(10)


def test_chunk_boundaries_and_eviction_keep_outputs_identical(tok, tiny_model_path, monkeypatch):
    monkeypatch.setattr(mlx_steps, "PREFILL_CHUNK", 16)
    rng = np.random.default_rng(2)
    base = [int(t) for t in rng.integers(3, 380, 70)]
    prompts = [
        base[:n] + [int(t) for t in rng.integers(3, 380, 9)] for n in (17, 33, 50, 70, 15, 64)
    ]
    bound = 90 * KV_BYTES_PER_TOKEN  # room for about one entry: evictions happen on the way
    off = start_scheduler(tiny_model_path, 1, prefix_cache_bytes=0)
    on = start_scheduler(tiny_model_path, 1, prefix_cache_bytes=bound)
    try:
        for p in prompts:
            want = _run_batch(off, tok, [p], 10)[0]
            got = _run_batch(on, tok, [p], 10)[0]
            assert got.tokens == want.tokens
            assert on.engine.prefix_cache.bytes <= bound
        stats = on.engine.prefix_cache.stats()
        assert stats.hits >= 3 and stats.entries >= 1
    finally:
        off.close(10)
        on.close(10)


def test_byte_bound_holds_under_distinct_long_prompts(tok, tiny_model_path):
    bound = 1000 * KV_BYTES_PER_TOKEN
    sched = start_scheduler(tiny_model_path, 4, prefix_cache_bytes=bound)
    rng = np.random.default_rng(8)
    try:
        seen_max = 0
        for _ in range(4):
            prompts = [[int(t) for t in rng.integers(3, 380, 300)] for _ in range(4)]
            _run_batch(sched, tok, prompts, 4)
            stats = sched.engine.prefix_cache.stats()
            seen_max = max(seen_max, stats.bytes)
            assert stats.bytes <= bound
        assert seen_max > bound // 2  # it filled up, and evicted to stay under the bound
        assert sched.engine.prefix_cache.stats().entries <= 3
    finally:
        sched.close(10)


def test_http_reports_cached_tokens_and_cache_stats(tiny_model_path, live_server):
    import httpx

    srv = live_server(tiny_model_path, concurrent=2)
    system = {"role": "system", "content": "Answer briefly and politely. " * 8}
    body = {
        "messages": [system, {"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        first = client.post("/v1/chat/completions", json=body).json()
        body["messages"][1]["content"] = "goodbye"
        second = client.post("/v1/chat/completions", json=body).json()
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    assert health["prefix_cache"]["hits"] == 1 and health["prefix_cache"]["hit_tokens"] == cached
    # the second prompt carried on the first history's row: no copy into the cache so far
    held, prompt = health["prefix_cache"]["kept_tokens"], second["usage"]["prompt_tokens"]
    assert prompt <= held <= prompt + second["usage"]["completion_tokens"]
    assert health["prefix_cache"]["bytes"] == 0 and health["prefix_cache"]["entries"] == 0
    assert "llm_server_prefix_cache_hit_tokens" in metrics
    assert f"llm_server_prefix_cache_kept_tokens {float(held)}" in metrics


def _kv(n: int) -> tuple[list[mx.array], list[mx.array]]:
    """KV of `n` positions for a 2-layer cache: 2 heads x 4 dims of float32 (128 bytes a position)."""
    return [mx.zeros((2, n, 4)) for _ in range(2)], [mx.ones((2, n, 4)) for _ in range(2)]


def test_short_unrelated_prompts_never_evict_a_long_prefix_being_hit():
    cache = PrefixCache(2400 * 128)  # the long prefix plus ten short entries
    rng = np.random.default_rng(3)
    long = [int(t) for t in rng.integers(1000, 3000, 2000)]
    cache.insert(long, *_kv(2000))
    assert cache.match(long + [5, 6])[1] == 2000  # the conversation's second turn
    for i in range(300):  # far more short prompts than fit, the long one hit every 25th
        # (LRU evicts it after ten: 25 evictions between hits)
        short = [int(t) for t in rng.integers(3, 900, 40)]
        assert cache.match(short)[1] < 40  # unrelated: nothing (or a few tokens) to reuse
        cache.insert(short, *_kv(40))
        assert cache.bytes <= cache.max_bytes
        if i % 25 == 24:
            entry, reused = cache.match(long + [5, 6])
            assert reused == 2000 and entry.tokens.tolist() == long, i
    assert cache.stats().entries > 2  # shorts were kept too, up to the bound


def test_an_abandoned_long_prefix_ages_out():
    cache = PrefixCache(1200 * 128)
    rng = np.random.default_rng(4)
    long = [int(t) for t in rng.integers(1000, 2000, 800)]
    cache.insert(long, *_kv(800))
    cache.match(long + [5])  # hit once, then never again
    for _ in range(400):
        cache.insert([int(t) for t in rng.integers(3, 900, 40)], *_kv(40))
    assert cache.match(long + [5]) == (None, 0)  # the clock caught up with it
    assert cache.bytes <= cache.max_bytes


def test_next_turn_replaces_the_entry_it_extends_and_keeps_its_hits():
    cache = PrefixCache(10_000 * 128)
    turn1 = list(range(10, 310))
    cache.insert(turn1, *_kv(300))
    cache.match(turn1 + [1])
    # the next turn resends turn 1 but its last few tokens differ (the answer re-rendered)
    turn2 = turn1[:-5] + list(range(500, 700))
    cache.insert(turn2, *_kv(len(turn2)))
    stats = cache.stats()
    assert stats.entries == 1 and stats.bytes == len(turn2) * 128
    entry, reused = cache.match(turn2 + [1])
    assert reused == len(turn2) and entry.hits == 2  # turn 1's hit carried over
    other = list(range(10, 60)) + list(range(900, 1300))  # shares 50 of 495: a new entry
    cache.insert(other, *_kv(len(other)))
    assert cache.stats().entries == 2


def test_default_bound_holds_two_agent_conversations_within_an_eighth_of_memory():
    smollm2 = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
    }
    per_token = kv_token_bytes(smollm2, 4)
    assert per_token == 46_080
    assert default_bound(per_token, memory=64 << 30) == 40_960 * 46_080  # 1.9 GB
    assert default_bound(per_token, memory=8 << 30) == 1 << 30  # an eighth of 8 GiB
    assert default_bound(512, memory=8 << 30) == 64 << 20  # a tiny model: the floor


def _kv_positions(tokens: list[int]) -> tuple[list[mx.array], list[mx.array]]:
    """KV whose every position carries its token id, to check which positions come back."""
    ids = mx.array(tokens, dtype=mx.float32)[None, :, None]
    keys = [mx.broadcast_to(ids, (2, len(tokens), 4)) + layer for layer in range(2)]
    return keys, [-k for k in keys]


def test_two_conversations_hold_their_shared_prefix_once():
    cache = PrefixCache(10_000 * 128)
    system = list(range(1000, 1400))  # 400 shared tokens (a system prompt and tools)
    a, b = system + list(range(10, 110)), system + list(range(200, 300))
    cache.insert(a, *_kv_positions(a))
    cache.insert(b, *_kv_positions(b))
    stats = cache.stats()
    assert stats.bytes == (400 + 100 + 100) * 128 and stats.entries == 3  # trunk + 2 tails
    for conv in (a, b):
        entry, reused = cache.match(conv + [5])
        assert reused == 500
        want_k, want_v = _kv_positions(conv)
        for got, want in zip(entry.keys + entry.values, want_k + want_v, strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want))
    c = system + list(range(500, 560))  # a third conversation hangs from the same trunk
    cache.insert(c, *_kv_positions(c))
    assert cache.stats().bytes == (400 + 100 + 100 + 60) * 128
    assert cache.match(system[:300] + [7])[1] == 300  # the trunk alone serves a prefix of it


def test_a_trunk_outlives_its_tails_and_the_bound_holds():
    cache = PrefixCache(700 * 128)
    system = list(range(1000, 1400))
    rng = np.random.default_rng(5)
    for _ in range(20):  # conversations on one system prompt, more than fit
        conv = system + [int(t) for t in rng.integers(3, 900, 100)]
        cache.insert(conv, *_kv_positions(conv))
        assert cache.bytes <= cache.max_bytes
        assert cache.match(system + [1])[1] == 400  # the shared prefix is always there


def test_outputs_identical_when_prefixes_come_from_a_trunk(tok, tiny_model_path):
    rng = np.random.default_rng(6)
    system = [int(t) for t in rng.integers(3, 380, 300)]

    def tail(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, 380, n)]

    a, b = system + tail(80), system + tail(90)
    prompts = [a, b, a + tail(20), b + tail(30), system + tail(40)]
    off = start_scheduler(tiny_model_path, 1, prefix_cache_bytes=0)
    on = start_scheduler(tiny_model_path, 1, prefix_cache_bytes=64 << 20)
    try:
        for i, p in enumerate(prompts):
            want = _run_batch(off, tok, [p], 10)[0]
            got = _run_batch(on, tok, [p], 10)[0]
            assert got.tokens == want.tokens, i
            if i >= 1:
                assert got.finish.cached_tokens >= 300, i
        assert on.engine.prefix_cache.stats().entries >= 3  # a trunk and its tails
    finally:
        off.close(10)
        on.close(10)
