"""Embedding spans in a prompt (engines/plan.py: `EmbeddingSpan`): rows computed elsewhere (a
vision tower later; here a test-only producer) take the place of the token embeddings at their
positions, in the one forward, batched with other rows; the prefix cache, kept rows and the disk
tier match a span by its content key, never by its placeholder ids.

The producer: rows of the model's own embedding table for other token ids (a span of the rows of
ids T must give exactly what the plain prompt with T gives), perturbed by fixed noise for content
the table does not hold.
"""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import mlx.core as mx
import numpy as np
import pytest

from llm_server.decoding import SamplingParams
from llm_server.engines.contract import EmbeddingInputUnsupported
from llm_server.engines.kv.prefix_disk import MAGIC, MAGIC_V1, DiskTier
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.plan import (
    DecodeRow,
    EmbeddingSpan,
    PrefillChunk,
    StepPlan,
    check_spans,
    prompt_key,
)
from llm_server.engines.settings import EngineSettings
from llm_server.testing.families import build_family_checkpoint
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, start_scheduler

PLACEHOLDER = 5  # the id a prompt holds at a span's positions


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 380, n)]


def table_rows(engine: MLXEngine, ids: list[int]) -> np.ndarray:
    """The producer's exact rows: the model's own token embeddings of `ids` [n, hidden]."""
    return np.array(engine.model.model.embed_tokens.weight[mx.array(ids)], dtype=np.float32)


def produced(engine: MLXEngine, ids: list[int], seed: int) -> np.ndarray:
    """Content the table does not hold: its rows of `ids` plus fixed noise of their scale."""
    rows = table_rows(engine, ids)
    noise = np.random.default_rng(seed).normal(0.0, 1.0, rows.shape).astype(np.float32)
    return rows + noise * float(rows.std())


# the prompt: 6 ids, a 10-position span, 5 ids
PREFIX, SPAN, SUFFIX = _ids(6, 1), _ids(10, 2), _ids(5, 3)
PLAIN = PREFIX + SPAN + SUFFIX
HOLDER = PREFIX + [PLACEHOLDER] * len(SPAN) + SUFFIX


def _greedy(engine: MLXEngine, row: int, logits: np.ndarray, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode([row], [out[-1]])[0]
    return out


# -- the key --------------------------------------------------------------------------------


def test_a_spans_cache_ids_are_negative_and_follow_its_content():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    a, same = EmbeddingSpan.of(2, rows), EmbeddingSpan.of(2, rows.copy())
    other = EmbeddingSpan.of(2, rows + 1)
    assert a.key == same.key and a.cache_ids == same.cache_ids and a == same
    assert a.key != other.key and all(
        x != y for x, y in zip(a.cache_ids, other.cache_ids, strict=True)
    )
    assert all(x < 0 for x in a.cache_ids) and len(set(a.cache_ids)) == 3
    assert EmbeddingSpan(0, rows, "digest").key == b"digest"
    key = prompt_key([9, 9, 5, 5, 5, 9], [a])
    assert key[:2] == [9, 9] and key[2:5] == list(a.cache_ids) and key[5] == 9
    assert prompt_key([9, 9, 5, 5, 5, 9], [a], 3, 6) == [*a.cache_ids[1:], 9]


def test_spans_that_do_not_fit_are_refused():
    rows = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="past the prompt"):
        check_spans([EmbeddingSpan.of(4, rows)], 6, 4)
    with pytest.raises(ValueError, match="overlap"):
        check_spans([EmbeddingSpan.of(0, rows), EmbeddingSpan.of(2, rows)], 9, 4)
    with pytest.raises(ValueError, match="the model 8"):
        check_spans([EmbeddingSpan.of(0, rows)], 6, 8)
    with pytest.raises(ValueError, match=r"\[n >= 1, hidden\]"):
        EmbeddingSpan.of(0, np.zeros(4, np.float32))


# -- (1) exactness: the forward takes the rows at the span's positions ----------------------


def test_a_span_of_table_rows_gives_the_plain_prompts_logits_and_tokens(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2, prefix_cache_bytes=0))
    assert engine.fused is not None  # the fused forward's embedding input
    span = EmbeddingSpan.of(len(PREFIX), table_rows(engine, SPAN))
    want = engine.prefill(0, PLAIN)
    got = engine.prefill(1, HOLDER, [span])
    np.testing.assert_array_equal(got, want)
    holder_alone = engine.prefill(1, HOLDER)  # the placeholders' own embeddings differ
    assert not np.allclose(holder_alone, want, atol=1e-3)
    got = engine.prefill(1, HOLDER, [span])
    assert _greedy(engine, 1, got, 8) == _greedy(engine, 0, want, 8)


def test_a_span_cut_by_chunks_rides_beside_decoding_rows(tiny_model_path):
    """Chunks start before, inside and after the span, each in one forward with a decode row:
    the same logits as the plain prompt run alone."""
    settings = EngineSettings(rows=2, prefix_cache_bytes=0)
    mixed, ref = MLXEngine(tiny_model_path, settings), MLXEngine(tiny_model_path, settings)
    span = EmbeddingSpan.of(len(PREFIX), table_rows(mixed, SPAN))
    other = _ids(9, 4)
    token = int(mixed.prefill(0, other).argmax())
    ref_token = int(ref.prefill(0, other).argmax())
    assert token == ref_token
    cuts = [0, 9, 13, len(HOLDER)]  # the span is positions 6..15
    for start, end in zip(cuts, cuts[1:], strict=False):
        plan = StepPlan(
            decode=(DecodeRow(0, token),),
            prefill=(PrefillChunk(1, 1, HOLDER, start, end, (span,)),),
        )
        got = mixed.run(plan)
        assert got.cursors == {1: end}
        decoded = ref.decode([0], [token])
        np.testing.assert_allclose(got.logits[0], decoded[0], rtol=0, atol=1e-5)
        token = int(got.logits[0].argmax())
    alone = MLXEngine(tiny_model_path, settings)
    for start, end in zip(cuts, cuts[1:], strict=False):
        plan = StepPlan(prefill=(PrefillChunk(1, 1, PLAIN, start, end),))
        want = alone.run(plan)
    np.testing.assert_allclose(got.logits[1], want.logits[0], rtol=0, atol=1e-5)
    assert got.logits[1].argmax() == want.logits[0].argmax()


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return build_family_checkpoint(tmp_path_factory.mktemp("spans") / "gemma3", "gemma3_text")


@pytest.mark.parametrize("model", ["qwen3-unfused", "gemma3_text"])
def test_mlx_lms_forward_takes_spans_as_input_embeddings(model, tiny_model_path, gemma3_path):
    """Models without the fused layers: mlx-lm's `input_embeddings` (gemma3_text: sliding
    windows, its own scaled embeddings and head)."""
    if model == "gemma3_text":
        engine = MLXEngine(gemma3_path, EngineSettings(rows=2, prefix_cache_bytes=0))
    else:
        settings = EngineSettings(rows=2, prefix_cache_bytes=0, fused_decode=False)
        engine = MLXEngine(tiny_model_path, settings)
    assert engine.fused is None
    span = EmbeddingSpan.of(len(PREFIX), table_rows(engine, SPAN))
    want = engine.prefill(0, PLAIN)
    np.testing.assert_allclose(engine.prefill(1, HOLDER, [span]), want, rtol=0, atol=1e-5)
    engine.release(1)  # and in two chunks, the first ending inside the span
    engine.run(StepPlan(prefill=(PrefillChunk(1, 1, HOLDER, 0, 11, (span,)),)))
    got = engine.run(StepPlan(prefill=(PrefillChunk(1, 1, HOLDER, 11, len(HOLDER), (span,)),)))
    np.testing.assert_allclose(got.logits[0], want, rtol=0, atol=1e-5)


def test_a_model_whose_forward_cannot_take_embeddings_refuses_them_at_admission(tmp_path):
    path = build_family_checkpoint(tmp_path / "phi3", "phi3")  # mlx-lm: no input_embeddings
    sched = start_scheduler(path, 1, prefix_cache_bytes=0)
    try:
        engine = sched.engine
        span = EmbeddingSpan.of(len(PREFIX), np.zeros((len(SPAN), 64), np.float32))
        with pytest.raises(EmbeddingInputUnsupported, match="cannot take embeddings"):
            engine.check_spans(len(HOLDER), [span])
        req, _ = make_request(Tokenizer(path), HOLDER, 4)
        req.embeddings = (span,)
        with pytest.raises(EmbeddingInputUnsupported, match="cannot take embeddings"):
            sched.submit(req)
        plain, out = make_request(Tokenizer(path), PLAIN, 4)
        sched.submit(plain)  # the model serves plain prompts as before
        assert out.done.wait(60) and len(out.tokens) == 4
    finally:
        sched.close(10)


# -- (2) batched == alone -----------------------------------------------------------------


def _serve(path, tok, prompts, concurrent: int, **kw):
    """Greedy outcomes of (prompt, spans) pairs admitted together."""
    sched = start_scheduler(path, concurrent, **kw)
    try:
        pairs = []
        for prompt, spans in prompts:
            req, out = make_request(tok, prompt, 12)
            req.embeddings = tuple(spans)
            pairs.append((req, out))
        sched.submit_all([req for req, _ in pairs])
        for _, out in pairs:
            assert out.done.wait(60)
        return [out for _, out in pairs]
    finally:
        sched.close(10)


def test_a_request_with_a_span_batched_with_text_rows_equals_it_alone(
    tiny_model_path, tiny_tokenizer
):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    span = EmbeddingSpan.of(len(PREFIX), produced(engine, SPAN, seed=7))
    texts = [(_ids(n, 20 + n), ()) for n in (3, 17, 29)]
    together = _serve(
        tiny_model_path,
        tiny_tokenizer,
        [texts[0], (HOLDER, (span,)), *texts[1:]],
        4,
        step_tokens=8,  # the span's chunks ride beside decoding rows
        prefix_cache_bytes=0,
    )
    (alone,) = _serve(tiny_model_path, tiny_tokenizer, [(HOLDER, (span,))], 1)
    assert together[1].tokens == alone.tokens and len(alone.tokens) == 12
    (plain,) = _serve(tiny_model_path, tiny_tokenizer, [(HOLDER, ())], 1)
    assert plain.tokens != alone.tokens  # the span, not the placeholders, made the answer
    for got, (prompt, _) in zip([together[0], *together[2:]], texts, strict=True):
        (want,) = _serve(tiny_model_path, tiny_tokenizer, [(prompt, ())], 1)
        assert got.tokens == want.tokens


def test_the_services_start_generation_and_an_exclusive_request_take_spans(
    tiny_model_path, tiny_tokenizer, make_service
):
    """`ModelService.start_generation(embeddings=)` and an exclusive request (the engine's
    whole-prompt `prefill`) give what the request gets in the step plans."""
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    span = EmbeddingSpan.of(len(PREFIX), produced(engine, SPAN, seed=7))
    (want,) = _serve(tiny_model_path, tiny_tokenizer, [(HOLDER, (span,))], 1)
    sched = start_scheduler(tiny_model_path, 2)
    try:
        req, out = make_request(tiny_tokenizer, HOLDER, 12)
        req.embeddings, req.exclusive = (span,), True
        sched.submit(req)
        assert out.done.wait(60) and out.tokens == want.tokens
    finally:
        sched.close(10)

    svc = make_service(tiny_model_path, 2)

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        handle = svc.start_generation(HOLDER, params, embeddings=(span,))
        return [ev.token_id async for ev in handle.events() if handle.finish is None]

    async def too_short() -> None:
        svc.start_generation(HOLDER[:10], SamplingParams(max_tokens=2), embeddings=(span,))

    assert asyncio.run(run()) == want.tokens
    with pytest.raises(ValueError, match="past the prompt"):
        asyncio.run(too_short())


# -- (3) the prefix cache keys a span by its content ---------------------------------------


def test_the_next_turn_reuses_a_span_and_a_different_span_stops_the_reuse_before_it(
    tiny_model_path, tiny_tokenizer
):
    """Through the scheduler on one row (its kept history): turn 2 with the same span reuses
    past it; the same placeholders with other content reuse only the
    positions before the span, and answer as a cold prompt with that content does."""
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    a = EmbeddingSpan.of(len(PREFIX), produced(engine, SPAN, seed=7))
    b = EmbeddingSpan.of(len(PREFIX), produced(engine, SPAN, seed=8))
    sched = start_scheduler(tiny_model_path, 1)
    try:

        def serve(prompt, spans):
            req, out = make_request(tiny_tokenizer, prompt, 8)
            req.embeddings = spans
            sched.submit(req)
            assert out.done.wait(60)
            return out

        first = serve(HOLDER, (a,))
        turn2 = HOLDER + first.tokens + _ids(7, 9)
        second = serve(turn2, (a,))
        assert second.finish.cached_tokens >= a.end  # the span's positions came from the cache
        other = serve(turn2, (b,))
        assert other.finish.cached_tokens == a.start  # the placeholders alone do not match
        assert other.tokens != second.tokens
        again = serve(turn2, (a,))  # back to a: b's KV is in the row now
        assert again.finish.cached_tokens == a.start and again.tokens == second.tokens
    finally:
        sched.close(10)
    (cold_b,) = _serve(tiny_model_path, tiny_tokenizer, [(turn2, (b,))], 1, prefix_cache_bytes=0)
    assert other.tokens == cold_b.tokens[:8]


def test_rows_the_prefix_cache_and_the_disk_tier_match_spans_by_content(tiny_model_path, tmp_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2))
    a, b, c = (
        EmbeddingSpan.of(len(PREFIX), produced(engine, SPAN, seed=seed)) for seed in (7, 8, 9)
    )
    cold = MLXEngine(tiny_model_path, EngineSettings(rows=1, prefix_cache_bytes=0))
    longer = HOLDER + [7, 8]
    want = {s.key: cold.prefill(0, longer, [s]) for s in (a, b, c)}

    # kept rows: the row keeping a's history is the one a's next prompt prefers, b's is b's
    engine.prefill(0, HOLDER, [a])
    engine.prefill(1, HOLDER, [b])
    engine.release(0)
    engine.release(1)
    for row, span in ((0, a), (1, b)):
        assert engine.preferred_row(prompt_key(longer, [span]), [0, 1]) == row

    # the histories saved to the prefix cache (the store given back) and to its disk tier
    engine.prefix_cache.attach_disk(DiskTier(tmp_path, 1 << 30, engine.kv_fingerprint()))
    engine.row_table.clear()
    engine.persist()
    assert len(list(tmp_path.glob("kv_*/*.kv"))) == 2  # a's and b's: by content

    # a running row holding a's prompt and the cache's entries give c the positions before it
    engine.prefill(0, HOLDER, [a])
    got = engine.prefill(1, longer, [c])
    assert engine.cached_tokens(1) == c.start
    np.testing.assert_allclose(got, want[c.key], rtol=0, atol=1e-5)
    engine.release(0)
    engine.release(1)
    for span in (a, b):  # a from its kept row, b from the prefix cache
        got = engine.prefill(0, longer, [span])
        assert engine.cached_tokens(0) == len(HOLDER)
        np.testing.assert_allclose(got, want[span.key], rtol=0, atol=1e-5)
        engine.release(0)

    restarted = MLXEngine(tiny_model_path, EngineSettings(rows=2))
    disk = DiskTier(tmp_path, 1 << 30, restarted.kv_fingerprint())
    restarted.prefix_cache.attach_disk(disk)
    got = restarted.prefill(0, longer, [a])
    assert restarted.cached_tokens(0) == len(HOLDER) and disk.reads == 1
    np.testing.assert_allclose(got, want[a.key], rtol=0, atol=1e-5)
    got = restarted.prefill(1, longer, [c])
    assert restarted.cached_tokens(1) == c.start and disk.reads == 1
    np.testing.assert_allclose(got, want[c.key], rtol=0, atol=1e-5)


def test_a_first_version_file_of_int32_ids_is_still_read(tmp_path):
    """Files written before spans (magic LLMPKV1, int32 ids) are read as before."""
    tokens = np.arange(300, 340, dtype=np.int64)
    keys = [mx.array(np.full((2, 40, 4), i, np.float32)) for i in range(2)]
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    tier.put(tokens, keys, keys)
    tier.close()
    (path,) = (tmp_path / "kv_a").glob("*.kv")
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    head_end = len(MAGIC) + 8 + struct.unpack_from("<Q", data, len(MAGIC))[0]
    header = json.loads(data[len(MAGIC) + 8 : head_end])
    body = data[head_end:]
    body = tokens.astype("<i4").tobytes() + body[8 * len(tokens) :]
    header["crc32"] = zlib.crc32(body)
    for _ in range(2):
        head = json.dumps(header).encode()
        header["size"] = len(MAGIC_V1) + 8 + len(head) + len(body)
    head = json.dumps(header).encode()
    path.write_bytes(MAGIC_V1 + struct.pack("<Q", len(head)) + head + body)
    again = DiskTier(tmp_path, 1 << 20, "kv_a")
    got_tokens, got_keys, _, _ = again.load_longest(np.arange(300, 345, dtype=np.int64), 0)
    assert got_tokens.tolist() == tokens.tolist() and again.corrupt == 0
    assert np.array_equal(np.array(got_keys[1]), np.array(keys[1]))
