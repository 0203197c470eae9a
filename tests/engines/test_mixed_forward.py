"""Mixed forwards: decoding rows and a newcomer's prompt chunk in ONE forward (S10 kept).

A chunk rides with 7 decoding rows, a long prompt is split over steps under a small
`--step-tokens`, and models without the fused layers (recurrent state, sliding windows) run
the same plans as separate graphs of one step; greedy output equals serving each alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.engines.contract import EngineError
from llm_server.engines.forward.fused import FusedForward
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.plan import DecodeRow, PrefillChunk, ScoreChunk, StepPlan
from llm_server.engines.settings import EngineSettings
from llm_server.testing.families import build_family_checkpoint
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, serve_alone, start_scheduler


class PlanRecorder(MLXEngine):
    """The real engine, keeping every plan it ran."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.plans: list[StepPlan] = []

    def run(self, plan):
        self.plans.append(plan)
        return super().run(plan)


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 380, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_a_chunk_in_the_forward_of_seven_decoding_rows_equals_alone(tiny_model_path, monkeypatch):
    prompts, newcomer = _prompts(7, seed=1), _prompts(1, seed=2, lo=40, hi=41)[0]
    mixed = MLXEngine(tiny_model_path, EngineSettings(rows=8, prefix_cache_bytes=0))
    ref = MLXEngine(tiny_model_path, EngineSettings(rows=8, prefix_cache_bytes=0))
    assert mixed.fused is not None  # the one-forward path, not separate graphs
    for row, p in enumerate(prompts):
        mixed.prefill(row, p)
        ref.prefill(row, p)
    forwards = []
    real = FusedForward.forward_groups
    monkeypatch.setattr(
        FusedForward,
        "forward_groups",
        lambda s, g, sp, every=frozenset(): forwards.append(len(g)) or real(s, g, sp, every),
    )
    tokens = [7 + r for r in range(7)]
    first = StepPlan(
        decode=tuple(DecodeRow(r, t) for r, t in enumerate(tokens)),
        prefill=(PrefillChunk(1, 7, newcomer, 0, 25),),
    )
    got = mixed.run(first)
    assert forwards == [2]  # ONE forward: the decoding rows and the chunk as two groups
    assert got.rows == tuple(range(7)) and got.cursors == {7: 25}  # prompt not done: no row 7
    np.testing.assert_array_equal(got.logits, ref.decode(list(range(7)), tokens))

    nxt = got.logits.argmax(-1).tolist()
    second = StepPlan(
        decode=tuple(DecodeRow(r, t) for r, t in enumerate(nxt)),
        prefill=(PrefillChunk(1, 7, newcomer, 25, 40),),
    )
    got = mixed.run(second)
    assert got.rows == (*range(7), 7) and got.cursors == {7: 40}
    want = np.concatenate([ref.decode(list(range(7)), nxt), ref.prefill(7, newcomer)[None]])
    assert got.logits.argmax(-1).tolist() == want.argmax(-1).tolist()
    np.testing.assert_allclose(got.logits, want, rtol=0, atol=1e-4)
    assert [mixed.cursor(r) for r in range(8)] == [ref.cursor(r) for r in range(8)]


def _serve_mixed(path, tok, prompts, late, n, step_tokens, **engine_kw):
    """`prompts` start decoding; then `late` arrives. Returns outcomes and the engine."""
    rows = len(prompts) + 1
    sched = start_scheduler(
        path, rows, engine_cls=PlanRecorder, step_tokens=step_tokens, **engine_kw
    )
    try:
        outs = []
        for p in prompts:
            req, out = make_request(tok, p, n, ignore_eos=True)
            sched.submit(req)
            outs.append(out)
        for out in outs:
            out.wait_first_token()  # every row decodes before the newcomer comes
        req, late_out = make_request(tok, late, 6, ignore_eos=True)
        sched.submit(req)
        for out in [*outs, late_out]:
            assert out.done.wait(120)
        return outs, late_out, req, sched.engine
    finally:
        sched.close(10)


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def test_a_long_prompt_is_split_over_steps_beside_seven_decoding_rows(tiny_model_path, tok):
    prompts, late = _prompts(7, seed=5), _prompts(1, seed=6, lo=70, hi=71)[0]
    n = 40  # the seven still decode while the late prompt is chunked in
    outs, late_out, req, engine = _serve_mixed(tiny_model_path, tok, prompts, late, n, 16)
    solo = [serve_alone(tiny_model_path, tok, p, n, ignore_eos=True).tokens for p in prompts]
    assert [o.tokens for o in outs] == solo
    assert late_out.tokens == serve_alone(tiny_model_path, tok, late, 6, ignore_eos=True).tokens
    chunks = [(p, c) for p in engine.plans for c in p.prefill if c.seq == req.seq]
    assert len(chunks) >= 7  # 70 tokens at most 9 per step
    assert all(p.tokens <= 16 for p, _ in chunks)
    assert any(len(p.decode) == 7 for p, _ in chunks)  # chunks rode with all seven rows
    assert [c.start for _, c in chunks[1:]] == [c.end for _, c in chunks[:-1]]  # contiguous
    assert chunks[-1][1].end == len(late)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_models_without_fused_layers_split_prompts_exactly(family, tmp_path):
    """Recurrent state (qwen3_next) and sliding windows (gemma3_text) carry across chunks."""
    path = build_family_checkpoint(tmp_path / family, family)
    tok = Tokenizer(path)
    prompts, late = _prompts(3, seed=7), _prompts(1, seed=8, lo=30, hi=31)[0]
    outs, late_out, req, engine = _serve_mixed(path, tok, prompts, late, 12, 8)
    assert engine.fused is None
    solo = [serve_alone(path, tok, p, 12, ignore_eos=True).tokens for p in prompts]
    assert [o.tokens for o in outs] == solo
    assert late_out.tokens == serve_alone(path, tok, late, 6, ignore_eos=True).tokens
    assert sum(c.seq == req.seq for p in engine.plans for c in p.prefill) >= 5


def _score_alone(engine: MLXEngine, prompt: list[int], k: int):
    """The reference: one prompt, one unpadded forward on the separate scoring session."""
    tokens = np.asarray([prompt], dtype=np.int32)
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    engine.score_begin(1)
    try:
        return engine.score_chunk(tokens, targets, k)
    finally:
        engine.score_end()


def test_the_scoring_rows_hold_memory_only_once_scoring_runs(tiny_model_path):
    """A server that never scores holds the KV of the serving rows in use alone (one request:
    one row): the scoring rows are allocated when a scoring chunk first runs, and given back
    with the rest when idle."""
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2, prefix_cache_bytes=0))
    assert engine.score_rows == 8
    prompt = _prompts(1, seed=8)[0]
    engine.prefill(0, prompt)
    logits = engine.decode([0], [5])
    rows_held = {k.shape[0] for k in engine.row_table.store.keys if k is not None}
    assert rows_held == {1}  # the serving row in use only
    per_row = engine.row_table.store.nbytes()
    scored = engine.run(StepPlan(decode=(DecodeRow(0, int(logits.argmax())),),
                                 score=(ScoreChunk(1, 2, prompt, 0, len(prompt), 0),)))  # fmt: skip
    assert {k.shape[0] for k in engine.row_table.store.keys if k is not None} == {10}
    assert engine.row_table.store.nbytes() == 10 * per_row
    assert scored.scores[2].token_logprobs.shape == (1, len(prompt))
    engine.release(2)
    engine.release(0)  # idle: the store is dropped, scoring rows and all
    assert engine.row_table.store.nbytes() == 0
    engine.prefill(1, prompt)  # row 1 alone: rows 0 and 1 held
    assert {k.shape[0] for k in engine.row_table.store.keys if k is not None} == {2}


@pytest.mark.parametrize("fused", [True, False])
def test_scoring_chunks_ride_in_the_decode_forward_and_equal_alone(tiny_model_path, fused):
    """Two scoring prompts on the store's scoring rows advance in chunks inside the forwards
    of 3 decoding rows: the decode logits are those of decoding alone, the log-probs those of
    scoring each prompt alone (C3), and the scoring rows end empty."""
    engine = MLXEngine(
        tiny_model_path, EngineSettings(rows=3, prefix_cache_bytes=0, fused_decode=fused)
    )
    ref = MLXEngine(
        tiny_model_path, EngineSettings(rows=3, prefix_cache_bytes=0, fused_decode=fused)
    )
    assert engine.score_rows == 8 and (engine.fused is not None) == fused
    prompts = _prompts(3, seed=5)
    for row, p in enumerate(prompts):
        engine.prefill(row, p)
        ref.prefill(row, p)
    scoring = _prompts(2, seed=6, lo=60, hi=61)[0], _prompts(1, seed=7, lo=9, hi=10)[0]
    rows = (3, 4)  # the scoring rows follow the serving rows
    tokens, parts = [5, 6, 7], {3: [], 4: []}
    cuts = {3: [(0, 20), (20, 45), (45, 60)], 4: [(0, 9), None, None]}
    for step in range(3):
        chunks = tuple(
            ScoreChunk(row, row, prompt, *cuts[row][step], top_k=3)
            for row, prompt in zip(rows, scoring, strict=True)
            if cuts[row][step] is not None
        )
        plan = StepPlan(decode=tuple(DecodeRow(r, t) for r, t in enumerate(tokens)), score=chunks)
        got = engine.run(plan)
        want = ref.decode([0, 1, 2], tokens)
        assert got.rows == (0, 1, 2)
        np.testing.assert_allclose(got.logits, want, rtol=0, atol=1e-4)
        assert got.logits.argmax(-1).tolist() == want.argmax(-1).tolist()
        for c in chunks:
            assert got.scores[c.row].token_logprobs.shape == (1, c.tokens)
            parts[c.row].append(got.scores[c.row])
        tokens = want.argmax(-1).tolist()
    for row, prompt in zip(rows, scoring, strict=True):
        alone = _score_alone(ref, prompt, 3)
        for field in ("token_logprobs", "top_logprobs"):
            joined = np.concatenate([getattr(p, field) for p in parts[row]], axis=1)
            np.testing.assert_allclose(joined, getattr(alone, field), rtol=0, atol=1e-4)
        for field in ("top_ids", "greedy_ids"):
            joined = np.concatenate([getattr(p, field) for p in parts[row]], axis=1)
            np.testing.assert_array_equal(joined, getattr(alone, field))
        assert engine.cursor(row) == len(prompt)
        engine.release(row)
    assert [engine.cursor(r) for r in rows] == [0, 0]
    with pytest.raises(EngineError, match="serving row"):
        engine.run(StepPlan(score=(ScoreChunk(1, 0, [1, 2], 0, 2, 0),)))
