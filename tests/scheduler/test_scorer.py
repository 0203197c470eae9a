"""Scoring (docs/ARCHITECTURE.md C1-C4) on the tiny model: padded batches on the separate session (the
fallback, a Scorer driven directly), and prompts on the engine's scoring rows riding in the
step plans' forwards beside decoding chats (through the service)."""

from __future__ import annotations

import asyncio
import logging

import mlx.core as mx
import numpy as np
import pytest

from llm_server.decoding import SamplingParams
from llm_server.engines.contract import SCORE_BUCKETS, SCORE_CHUNK, EngineError
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler import FinishEvent, QueueFull, TokenEvent
from llm_server.scheduler.score_session import chunk_sizes, padded_rows
from llm_server.scheduler.scorer import ScoredPrompt, Scorer, ScoringError
from llm_server.scheduler.shortest_first import batch_size

TOL = 1e-4  # float32 scores, padded batch vs alone


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> MLXEngine:
    """An engine that asks for padded scoring shapes, so the C4 rules show in the trace."""
    return MLXEngine(tiny_model_path, EngineSettings(padded_shapes=True))


def prompts_of(lengths: list[int], seed: int, vocab: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def score_alone(engine: MLXEngine, prompt: list[int], top_k: int):
    """The reference: one prompt, one unpadded forward of exactly its length."""
    tokens = np.asarray([prompt], dtype=np.int32)
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    engine.score_begin(1)
    try:
        return engine.score_chunk(tokens, targets, max(top_k, 1))
    finally:
        engine.score_end()


def assert_scores_match(engine, prompt, got: ScoredPrompt, top_k: int, generate_one: bool):
    ref = score_alone(engine, prompt, top_k)
    n = len(prompt)
    assert got.tokens[:n] == prompt
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    want = list(ref.token_logprobs[0, : n - 1])
    if generate_one:
        assert got.generated == int(ref.greedy_ids[0, n - 1])
        assert got.tokens == [*prompt, got.generated]
        want.append(float(ref.top_logprobs[0, n - 1, 0]))
    else:
        assert got.generated is None and len(got.tokens) == n
    assert len(got.token_logprobs) == len(got.top_logprobs) == len(want) + 1
    np.testing.assert_allclose(got.token_logprobs[1:], want, atol=TOL, rtol=0)
    for i, top in enumerate(got.top_logprobs[1:]):
        assert len(top) == top_k
        np.testing.assert_allclose([lp for _, lp in top], ref.top_logprobs[0, i, :top_k], atol=TOL)


def drain(scorer: Scorer, engine) -> None:
    while scorer.pending():
        scorer.run_batch(engine)


class RecordingEngine:
    """Wraps a real engine; logs decode and scoring forwards in the order they ran."""

    def __init__(self, inner: MLXEngine, poison: int | None = None) -> None:
        self._inner = inner
        self.poison = poison
        self.fail_begin = False
        self.events: list[tuple[str, int]] = []  # ("decode", rows) | ("score", offset)
        self.plans: list = []  # every step plan run, in order
        self._offset = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def decode(self, rows, tokens):
        self.events.append(("decode", len(rows)))
        return self._inner.decode(rows, tokens)

    def run(self, plan):  # the scheduler's entry point (step plans)
        self.plans.append(plan)
        if plan.decode:
            self.events.append(("decode", len(plan.decode)))
        return self._inner.run(plan)

    def decode_start(self, rows, tokens):
        self.events.append(("decode", len(rows)))
        return self._inner.decode_start(rows, tokens)

    def score_begin(self, batch: int) -> None:
        if self.fail_begin:
            raise EngineError("no memory for a scoring session")
        self._offset = 0
        self._inner.score_begin(batch)

    def score_chunk(self, tokens, targets, top_k):
        self.events.append(("score", self._offset))
        self._offset += tokens.shape[1]
        if self.poison is not None and (tokens == self.poison).any():
            raise EngineError("poisoned token in the batch")
        return self._inner.score_chunk(tokens, targets, top_k)


# -- batch-forming rules (pure) ------------------------------------------------------


def test_batch_size_stops_before_a_third_is_padding():
    assert batch_size([5, 10, 12, 14, 20], 32) == 4  # +20: 39 of 100 positions pad
    assert batch_size([20, 40, 41, 129], 32) == 3
    assert batch_size([1, 2], 32) == 2  # 1 of 4 positions pad
    assert batch_size([1, 3], 32) == 1  # 2 of 6 positions pad: exactly a third, so stop
    assert batch_size([7] * 40, 32) == 32  # the row cap
    assert batch_size([9], 4) == 1


def test_chunk_sizes_and_buckets():
    assert chunk_sizes(1, 1024) == [16]
    assert chunk_sizes(17, 1024) == [32]
    assert chunk_sizes(64, 1024) == [64]
    assert chunk_sizes(128, 1024) == [128]
    assert chunk_sizes(129, 1024) == [128, 16]
    assert chunk_sizes(300, 1024) == [128, 128, 64]
    assert chunk_sizes(290, 300) == [128, 128, 44]  # the bucket would pass the context
    assert chunk_sizes(10, 12) == [12]


def test_padded_rows_round_to_power_of_two_on_dynamic_graphs():
    assert [padded_rows(n, 32, True) for n in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert padded_rows(3, 3, True) == 3  # never above the cap
    assert padded_rows(3, 32, False) == 3  # a fixed-shape engine pads rows itself


# -- the scorer on the real engine ---------------------------------------------------


def test_trace_shortest_first_padding_rule_chunks_and_buckets(engine):
    scorer = Scorer()
    a = prompts_of([10, 300, 14, 40, 5], seed=1)
    b = prompts_of([41, 12, 129, 20], seed=2)
    req_a = scorer.submit(a, 2, True)
    req_b = scorer.submit(b, 0, False)
    drain(scorer, engine)

    batches: dict[int, list] = {}
    for fwd in scorer.trace:
        batches.setdefault(fwd.batch, []).append(fwd)
    lengths = [fwds[0].lengths for fwds in batches.values()]
    # shortest first across both requests; each batch stops before a third would be padding
    assert lengths == [(5, 10, 12, 14), (20, 40, 41), (129, 300)]
    for fwds in batches.values():
        first = fwds[0]
        n = len(first.lengths)
        assert first.rows == 1 << (n - 1).bit_length()
        assert [f.offset for f in fwds] == list(np.cumsum([0] + [f.q for f in fwds[:-1]]))
        assert all(f.q == SCORE_CHUNK for f in fwds[:-1])
        assert fwds[-1].q in SCORE_BUCKETS
        rest = max(first.lengths) - fwds[-1].offset
        assert fwds[-1].q == min(b for b in SCORE_BUCKETS if b >= rest)
    assert [f.q for f in batches[3]] == [128, 128, 64]

    for prompt, got in zip(a, req_a.future.result(0), strict=True):
        assert_scores_match(engine, prompt, got, 2, True)
    for prompt, got in zip(b, req_b.future.result(0), strict=True):
        assert_scores_match(engine, prompt, got, 0, False)


def test_last_chunk_never_passes_the_context(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(context_length=300, padded_shapes=True))
    scorer = Scorer()
    prompts = prompts_of([290, 300], seed=3)
    req = scorer.submit(prompts, 1, True)
    drain(scorer, engine)
    assert [(f.q, f.offset) for f in scorer.trace] == [(128, 0), (128, 128), (44, 256)]
    for prompt, got in zip(prompts, req.future.result(0), strict=True):
        assert_scores_match(engine, prompt, got, 1, True)


def test_long_batch_is_chunked_and_memory_stays_bounded(engine):
    """32 prompts of 1,000 tokens never run [N, 1000, vocab] in one forward."""
    prompts = prompts_of([1000] * 32, seed=4, vocab=engine.vocab_size)
    scorer = Scorer()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    req = scorer.submit(prompts, 1, True)
    drain(scorer, engine)
    chunked_peak = mx.get_peak_memory() - base
    assert {(f.rows, f.q) for f in scorer.trace} == {(32, 128)}
    assert len(scorer.trace) == 8  # ceil(1000 / 128)
    assert len(req.future.result(0)) == 32
    # one unchunked forward would hold the logits [N, T, vocab] and the attention scores
    # [N, heads, T, T] of the whole prompt (float32); chunking keeps the peak well below
    n, t, heads = 32, 1000, engine.config["num_attention_heads"]
    whole = n * t * (engine.vocab_size + heads * t) * 4
    assert chunked_peak < whole / 3


def test_engine_error_fails_only_that_batch(engine, caplog):
    poison = 7
    wrapped = RecordingEngine(engine, poison=poison)
    scorer = Scorer()
    bad = scorer.submit([[poison] * 200, [1, 2, 3]], 1, True)  # its long prompt fails
    good = scorer.submit([[4, 5, 6, 8]], 1, True)
    with caplog.at_level(logging.ERROR):
        drain(scorer, wrapped)
    with pytest.raises(ScoringError, match="poisoned token"):
        bad.future.result(0)
    assert_scores_match(engine, [4, 5, 6, 8], good.future.result(0)[0], 1, True)
    assert "scoring batch" in caplog.text
    # the scorer keeps working after a failure, also one in opening the session
    wrapped.fail_begin = True
    no_session = scorer.submit([[1, 2]], 1, False)
    drain(scorer, wrapped)
    with pytest.raises(ScoringError, match="no memory for a scoring session"):
        no_session.future.result(0)
    wrapped.fail_begin = False
    again = scorer.submit([[1, 2, 3]], 1, False)
    drain(scorer, wrapped)
    assert_scores_match(engine, [1, 2, 3], again.future.result(0)[0], 1, False)


def test_cancelled_request_is_skipped_and_queue_is_bounded(engine):
    scorer = Scorer(max_queued=2)
    dropped = scorer.submit([[1, 2, 3]], 1, False)
    kept = scorer.submit([[4, 5]], 1, False)
    with pytest.raises(QueueFull):
        scorer.submit([[6]], 1, False)
    assert dropped.future.cancel()
    drain(scorer, engine)
    assert [f.requests for f in scorer.trace] == [(kept.seq,)]
    assert kept.future.result(0)[0].tokens == [4, 5]
    scorer.submit([[6]], 1, False)  # both slots came back


# -- through the service: concurrent requests while chat decodes -------------------


async def generate(svc, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    handle = svc.start_generation(prompt, params)
    tokens = []
    async for ev in handle.events():
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            assert ev.error is None
    return tokens


def test_scores_equal_alone_while_chat_decodes(tiny_model_path, make_service, engine):
    recorder: list[RecordingEngine] = []

    def factory():
        recorder.append(RecordingEngine(MLXEngine(tiny_model_path, EngineSettings(rows=4))))
        return recorder[0]

    svc = make_service(tiny_model_path, 4, engine_factory=factory)
    chats = [
        svc.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Hello, how are you?", "Count to ten.")
    ]
    score_sets = [
        (prompts_of([1, 7, 50, 130, 300, 64], seed=5), 3, True),
        (prompts_of([3, 200, 128, 129], seed=6), 1, True),
        (prompts_of([16, 17, 33, 2], seed=7), 0, False),
    ]

    async def run_alone():
        return [await generate(svc, c, 48) for c in chats]

    async def run_together():
        gens = [asyncio.ensure_future(generate(svc, c, 48)) for c in chats]
        await asyncio.sleep(0)
        scores = [asyncio.ensure_future(svc.score(p, k, g)) for p, k, g in score_sets]
        return await asyncio.gather(*gens), await asyncio.gather(*scores)

    alone = asyncio.run(run_alone())
    plans = recorder[0].plans
    plans.clear()
    together, scored = asyncio.run(run_together())

    assert together == alone  # chat output is token-identical with scoring in the forwards
    for (prompts, k, gen), results in zip(score_sets, scored, strict=True):
        assert len(results) == len(prompts)
        for prompt, got in zip(prompts, results, strict=True):
            assert_scores_match(engine, prompt, got, k, gen)

    # the scoring prompts rode in the step plans on the scoring rows (no session forward):
    # beside decoding rows within the step budget (C1), at most SCORE_CHUNK positions per
    # prompt per forward (C3), and every position of every prompt ran exactly once
    assert len(svc.scorer.trace) == 0
    budget = svc.scheduler.step_tokens
    assert any(p.decode and p.score for p in plans)
    assert all(p.tokens <= budget for p in plans if p.decode)
    # a step without decode rows stalls nobody: its prompt chunks take the prefill budget
    assert all(p.tokens <= max(budget, svc.scheduler.prefill_tokens) for p in plans if p.prefill)
    chunks = [c for p in plans for c in p.score]
    assert all(c.row >= 4 and c.tokens <= SCORE_CHUNK for c in chunks)
    spans: dict[int, list] = {}
    for c in chunks:
        spans.setdefault(c.key, []).append((c.start, c.end, len(c.prompt)))
    for ranges in spans.values():  # each prompt's chunks tile it from 0 to its end
        assert [lo for lo, _, _ in ranges] == [0] + [hi for _, hi, _ in ranges[:-1]]
        assert ranges[-1][1] == ranges[-1][2]
    want = sorted(len(p) for ps, _, _ in score_sets for p in ps)
    assert sorted(ranges[-1][2] for ranges in spans.values()) == want


@pytest.mark.parametrize("concurrent", [1, 4])
def test_lm_eval_request_shape_at_service_level(tiny_model_path, make_service, engine, concurrent):
    """`{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true}` as lm-eval sends it."""
    svc = make_service(tiny_model_path, concurrent)
    ids = svc.tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    [got] = asyncio.run(svc.score([ids], top_k=1, generate_one=True))
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == len(ids) + 1
    assert_scores_match(engine, ids, got, 1, True)
    # lm-eval reads token_logprobs[ctxlen:-1] as the continuation's log-likelihood
    assert got.token_logprobs[-1] == got.top_logprobs[-1][0][1]


def test_service_rejects_bad_scoring_requests(tiny_model_path, make_service):
    svc = make_service(tiny_model_path, 1)

    async def score(prompts, top_k=1):
        return await svc.score(prompts, top_k, False)

    with pytest.raises(ValueError, match="must not be empty"):
        asyncio.run(score([]))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        asyncio.run(score([[1], []]))
    with pytest.raises(ValueError, match="2000 tokens; the model's context is 1024"):
        asyncio.run(score([[1] * 2000]))
    with pytest.raises(ValueError, match="logprobs must be between 0 and 20"):
        asyncio.run(score([[1]], top_k=21))


def test_exact_shapes_on_an_engine_without_shape_costs(tiny_model_path):
    """MLX runs any shape without a compile: no power-of-two rows, no bucket padding."""
    engine = MLXEngine(tiny_model_path)
    assert engine.padded_shapes is False
    scorer = Scorer()
    prompts = prompts_of([5, 10, 12, 14, 20, 40, 41, 129, 300], seed=6)
    req = scorer.submit(prompts, 1, True)
    drain(scorer, engine)
    shapes = [(f.rows, f.q, f.offset) for f in scorer.trace]
    assert shapes == [(4, 14, 0), (3, 41, 0), (2, 128, 0), (2, 128, 128), (2, 44, 256)]
    for prompt, got in zip(prompts, req.future.result(0), strict=True):
        assert_scores_match(engine, prompt, got, 1, True)
