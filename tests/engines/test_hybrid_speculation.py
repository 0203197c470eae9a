"""Speculation and scoring on hybrid models (recurrent layers + attention), issue 45 item 4.

A drafted row's recurrent state after the verifying forward includes its rejected positions:
a rewind restores the state from before the step and runs the kept positions again
(executor.py: `StepExecutor.rewind`). Greedy output with drafts (all right, all wrong, partly
right) equals it without, alone and batched; scoring rows clear a row's state when a prompt
opens it and carry it across its chunks, giving a lone forward's log-probabilities.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from llm_server.decoding import FinishReason
from llm_server.engines.contract import EngineError
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.plan import DecodeRow, ScoreChunk, StepPlan
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler.scorer import Scorer
from llm_server.tokenizer import Tokenizer
from tests.engines.test_hybrid_prefix import HYBRIDS
from tests.scheduler.helpers import make_request, serve_together
from tests.scheduler.test_scorer import TOL, generate, score_alone

K = 4
NEW = 16


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 380, n)]


def _greedy(engine: MLXEngine, row: int, prompt: list[int], n: int = NEW) -> list[int]:
    logits, out = engine.prefill(row, prompt), []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == n:
            return out
        logits = engine.decode([row], [out[-1]])[0]


def _draft(ref: list[int], done: int, step: int) -> list[int]:
    """The reference's next K ids with the ones from `step % (K + 1)` on wrong: every split
    of accepted and rejected ids in turn (all wrong, 1 right, ..., all right)."""
    nxt = ref[done : done + K]
    right = step % (K + 1)
    return nxt[:right] + [(t + 1) % 384 for t in nxt[right:]]


@pytest.mark.parametrize("family", HYBRIDS)
def test_partly_rejected_drafts_keep_the_output_exactly(family, checkpoint):
    """Row 0 verifies drafts of every accepted/rejected split beside row 1 decoding plainly:
    both answers equal the same prompts decoded alone, and row 0 holds only its real tokens."""
    path = checkpoint(family)
    prompts = [_ids(1, 40), _ids(2, 23)]
    alone = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0))
    want = []
    for p in prompts:
        want.append(_greedy(alone, 0, p))
        alone.release(0)
    engine = MLXEngine(path, EngineSettings(rows=2, prefix_cache_bytes=0))
    assert engine.speculative and not engine.pipelined
    got = [[int(np.argmax(engine.prefill(r, p)))] for r, p in enumerate(prompts)]
    step = 0
    while len(got[0]) < NEW or len(got[1]) < NEW:
        base = engine.cursor(0)
        draft = _draft(want[0], len(got[0]), step)
        decode = [DecodeRow(0, got[0][-1], tuple(draft))] if len(got[0]) < NEW else []
        if len(got[1]) < NEW:
            decode.append(DecodeRow(1, got[1][-1]))
        result = engine.run(StepPlan(decode=tuple(decode)))
        at = dict(zip(result.rows, result.logits, strict=True))
        if 1 in at:
            got[1].append(int(np.argmax(at[1])))
        if 0 in at:
            kept = 0
            for i, logits in enumerate([at[0], *result.verified[0]]):
                got[0].append(int(np.argmax(logits)))
                if i == len(draft) or got[0][-1] != draft[i]:
                    break
                kept += 1
            engine.rewind(0, base + 1 + kept)
        step += 1
    assert [g[:NEW] for g in got] == want
    assert engine.row_table.tokens[0] == prompts[0] + got[0][: engine.cursor(0) - 40]


MAMBA2 = {"granitemoehybrid", "nemotron_h", "falcon_h1"}


@pytest.mark.parametrize("family", HYBRIDS)
def test_verified_logits_equal_plain_decoding(family, checkpoint):
    """A verified draft's logits, and those after a rewind's re-run, are plain decoding's: bit
    for bit on gated delta and convolution layers; within 1e-4 on mamba2, whose mlx-lm SSM sums
    a run of positions in one product (as for a prompt prefilled in other chunks)."""
    engine = MLXEngine(checkpoint(family), EngineSettings(rows=1, prefix_cache_bytes=0))
    prompt = _ids(12, 40)
    ids, want = [int(np.argmax(engine.prefill(0, prompt)))], []
    for _ in range(K + 1):
        want.append(engine.decode([0], [ids[-1]])[0])
        ids.append(int(np.argmax(want[-1])))
    engine.release(0)
    engine.prefill(0, prompt)
    result = engine.run(StepPlan(decode=(DecodeRow(0, ids[0], tuple(ids[1:K])),)))
    engine.rewind(0, len(prompt) + 3)  # the pending token and 2 of the 3 draft ids kept
    got = [result.logits[0], *result.verified[0], engine.decode([0], [ids[3]])[0]]
    tol = 1e-4 if family in MAMBA2 else 0.0
    for g, w in zip(got, [*want[:K], want[3]], strict=True):
        np.testing.assert_allclose(g, w, atol=tol, rtol=0)


def test_a_rewind_outside_the_last_drafted_step_is_refused(checkpoint):
    """A stateful row cannot cut its state back past the step that drafted: such a rewind is
    refused, never a corrupted state; rewinding to the cursor itself is a no-op."""
    engine = MLXEngine(checkpoint("qwen3_5"), EngineSettings(rows=1))
    engine.prefill(0, _ids(16, 20))
    engine.rewind(0, 20)
    with pytest.raises(EngineError):
        engine.rewind(0, 10)
    engine.run(StepPlan(decode=(DecodeRow(0, 5, (6, 7, 8)),)))
    with pytest.raises(EngineError):
        engine.rewind(0, 19)  # before the drafted step's start
    engine.rewind(0, 22)
    assert engine.cursor(0) == 22


def _serve(path, prompts, max_tokens, speculative="off", hook=None):
    tok = Tokenizer(path)
    made = [make_request(tok, p, max_tokens) for p in prompts]
    sched = serve_together(
        lambda: MLXEngine(path, EngineSettings(rows=2)),
        made,
        hook,
        max_concurrent=2,
        max_queued=16,
        speculative=speculative,
        spec_tokens=K,
    )
    return [out.tokens for _, out in made], sched


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid", "lfm2"])
def test_ngram_and_injected_drafts_through_the_scheduler(family, checkpoint):
    """Through the real BatchScheduler, two rows together: prompt-lookup drafts on repetitive
    prompts, then injected drafts right but for their last id, give the output without drafts."""
    path = checkpoint(family)
    prompts = [list(range(5, 25)) * 3, [7, 8, 9, 10] * 8]
    want, _ = _serve(path, prompts, 24)
    got, sched = _serve(path, prompts, 24, "ngram")
    assert got == want and sched.drafted_tokens > 0
    refs = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

    def hook(req):
        done = len(req.decoder.tokens)
        nxt = refs[tuple(req.prompt)][done : done + K]
        return nxt[:-1] + [(nxt[-1] + 1) % 384] if nxt else nxt

    got, sched = _serve(path, prompts, 24, hook=hook)
    assert got == want
    assert 0 < sched.accepted_tokens < sched.drafted_tokens


class FailingRerun(MLXEngine):
    """Its re-runs after a rejected draft fail on the row holding `FAIL` (out of memory)."""

    FAIL: list[int] = []

    def rewind(self, row: int, cursor: int) -> None:
        held = self.row_table.tokens[row]
        if cursor == self.cursor(row) or held[: len(self.FAIL)] != self.FAIL:
            return super().rewind(row, cursor)
        run = self.forward.run_groups
        self.forward.run_groups = _oom
        try:
            super().rewind(row, cursor)
        finally:
            self.forward.run_groups = run


def _oom(*_a, **_kw):
    raise RuntimeError("simulated out-of-memory in the re-run")


def test_a_failed_rerun_fails_only_its_request(checkpoint):
    """A rewind whose re-run fails ends that request with an error; the row beside it keeps
    decoding exactly."""
    path = checkpoint("qwen3_5")
    tok = Tokenizer(path)
    prompts = [_ids(10, 30), _ids(11, 25)]
    want, _ = _serve(path, prompts, 12)
    FailingRerun.FAIL = prompts[0]

    def hook(req):
        done = len(req.decoder.tokens)
        return [(t + 1) % 384 for t in want[prompts.index(req.prompt)][done : done + K]]

    made = [make_request(tok, p, 12) for p in prompts]
    serve_together(
        lambda: FailingRerun(path, EngineSettings(rows=2)),
        made,
        hook,
        max_concurrent=2,
        max_queued=16,
        spec_tokens=K,
    )
    (_, failed), (_, other) = made
    assert failed.reason == FinishReason.ERROR and "simulated" in failed.finish.error
    assert other.tokens == want[1]


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid", "falcon_h1"])
def test_scoring_rows_equal_a_lone_forward(family, checkpoint):
    """Scoring rides on the scoring rows (the state slot cleared when a prompt opens the row,
    carried across its chunks) beside a decoding row; two prompts in turn on one row give
    the log-probabilities and greedy ids of each prompt's lone forward."""
    engine = MLXEngine(checkpoint(family), EngineSettings(rows=2))
    assert engine.score_rows > 0 and Scorer().attach(engine)
    row = engine.rows
    engine.prefill(0, _ids(3, 12))
    for prompt in (_ids(4, 37), _ids(5, 21)):
        ref = score_alone(engine, prompt, 3)
        parts = []
        for start in range(0, len(prompt), 16):
            chunk = ScoreChunk(1, row, prompt, start, min(start + 16, len(prompt)), 3)
            result = engine.run(StepPlan(decode=(DecodeRow(0, 5),), score=(chunk,)))
            parts.append(result.scores[row])
        got = np.concatenate([p.token_logprobs for p in parts], axis=1)
        np.testing.assert_allclose(got, ref.token_logprobs, atol=TOL, rtol=0)
        top = np.concatenate([p.top_logprobs for p in parts], axis=1)
        np.testing.assert_allclose(top, ref.top_logprobs[:, :, :3], atol=TOL, rtol=0)
        greedy = np.concatenate([p.greedy_ids for p in parts], axis=1)
        assert np.array_equal(greedy, ref.greedy_ids)


def test_lm_eval_scoring_on_a_hybrid_service(checkpoint, make_service):
    """The lm-eval path on a hybrid (echo + logprobs): scored on the scoring rows, no session
    forward, each prompt equal to its lone forward, while a chat decodes."""
    path = checkpoint("qwen3_5")
    svc = make_service(path, 2)
    engine = MLXEngine(path, EngineSettings(rows=1))
    prompts = [_ids(s, n) for s, n in ((6, 9), (7, 140), (8, 33))]

    chat = _ids(9, 30)
    alone = asyncio.run(generate(svc, chat, 24))

    async def together():
        answer = asyncio.ensure_future(generate(svc, chat, 24))
        await asyncio.sleep(0)
        scored = await svc.score(prompts, 2, True)
        return await answer, scored

    answer, scored = asyncio.run(together())
    assert answer == alone
    assert len(svc.scorer.trace) == 0  # no padded session batch ran
    for prompt, got in zip(prompts, scored, strict=True):
        ref = score_alone(engine, prompt, 2)
        n = len(prompt)
        assert got.generated == int(ref.greedy_ids[0, n - 1])
        want = list(ref.token_logprobs[0, : n - 1]) + [float(ref.top_logprobs[0, n - 1, 0])]
        np.testing.assert_allclose(got.token_logprobs[1:], want, atol=TOL, rtol=0)
