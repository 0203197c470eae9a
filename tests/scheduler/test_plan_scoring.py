"""Scoring chunks in the step plan (the engine's scoring rows) on the fake engine: the budget
they share with decode rows, decode rows advancing every step beside a long scoring batch, a
failed chunk failing only its request (C1, C3, S8)."""

from __future__ import annotations

from types import SimpleNamespace

from llm_server.engines.contract import SCORE_CHUNK
from llm_server.scheduler import GenerationRequest
from llm_server.scheduler.planner import plan
from llm_server.scheduler.scorer import Scorer
from tests.scheduler.fakes import alone, drain, fake_scores, request, scheduler


def _open(prompt: list[int], row: int, done: int = 0) -> SimpleNamespace:
    """What the planner reads of an open scoring prompt (scorer.OpenPrompt)."""
    return SimpleNamespace(key=row, row=row, prompt=prompt, done=done, top_k=1)


def _decoding(rows: int) -> dict[int, GenerationRequest]:
    running = {}
    for row in range(rows):
        req, _ = request([1, 2])
        req.row, req.prefilled, req.last_token = row, 2, 9
        running[row] = req
    return running


def test_a_scoring_chunk_respects_the_step_budget_together_with_decode_rows():
    long, short = _open(list(range(1, 301)), 8, done=40), _open([5] * 20, 9)
    p = plan([], _decoding(7), [7], budget=32, scoring=[long, short])
    assert [d.row for d in p.decode] == list(range(7))
    assert [(c.row, c.start, c.end) for c in p.score] == [(8, 40, 65)]  # 32 - 7 decode rows
    assert p.tokens == 32
    p = plan([], _decoding(7), [7], budget=64, scoring=[long, short])
    assert [(c.row, c.start, c.end) for c in p.score] == [(8, 40, 97)] and p.tokens == 64
    # a prompt chunk goes first; scoring gets what it leaves (here nothing)
    newcomer, _ = request(list(range(3, 103)))
    p = plan([newcomer], _decoding(7), [7], budget=32, scoring=[long])
    assert [(c.start, c.end) for c in p.prefill] == [(0, 25)] and p.score == ()
    # with no row generating nobody is stalled: every open prompt advances a chunk (C3)
    p = plan([], {}, [0], budget=32, scoring=[long, short])
    assert [(c.row, c.start, c.end) for c in p.score] == [(8, 40, 40 + SCORE_CHUNK), (9, 0, 20)]
    # no scoring while a pipelined step is in flight
    assert plan([], _decoding(2), [], budget=32, admit=False, scoring=[long]).score == ()


def test_decode_rows_keep_advancing_every_step_while_a_long_scoring_batch_runs():
    scorer = Scorer()
    sched = scheduler(2, 32, scorer=scorer, score_rows=2)
    chats = []
    for prompt in ([1, 2, 3], [4, 5]):
        req, out = request(prompt, 40)
        sched.submit(req)
        chats.append(out)
    sched.step()  # both prompts prefilled
    prompts = [list(range(1 + i, 151 + i)) for i in range(4)]  # 600 positions to score
    scored = scorer.submit(prompts, 1, True, context_length=4096)
    steps = []
    while not scored.future.done():
        p = sched.step()
        steps.append(p)
        assert [d.row for d in p.decode] == [0, 1]  # never paused for the scoring batch
        assert p.tokens <= 32 and all(c.row in (2, 3) for c in p.score)
    assert all(p.score for p in steps) and len(steps) == 20  # 600 positions, 30 a step
    assert all(len(out.tokens) == 1 + len(steps) for out in chats)
    for prompt, got in zip(prompts, scored.future.result(0), strict=True):
        want = fake_scores(prompt, 0, len(prompt), 1)
        assert got.token_logprobs[:-1] == [None, *want.token_logprobs[0, :-1].tolist()]
        assert got.generated == int(want.greedy_ids[0, -1]) == got.tokens[-1]
    drain(sched)
    assert [o.tokens for o in chats] == [alone([1, 2, 3], 40), alone([4, 5], 40)]
    assert sched.engine.plans[-1].score == () and sorted(scorer._free) == [2, 3]


def test_a_failed_scoring_chunk_fails_only_its_request():
    scorer = Scorer()
    sched = scheduler(1, 64, scorer=scorer, score_rows=2)
    chat, chat_out = request([1, 2], 6)
    sched.submit(chat)
    sched.engine.fail_rows = {13}  # scoring prompts starting with 13 fail in the forward
    bad = scorer.submit([[13] * 30, [7] * 3], 0, False, context_length=4096)
    good = scorer.submit([[4] * 50], 2, False, context_length=4096)
    drain(sched)
    assert "simulated" in str(bad.future.exception(0))
    [got] = good.future.result(0)
    assert got.token_logprobs[1:] == fake_scores([4] * 50, 0, 50, 2).token_logprobs[0, :-1].tolist()
    assert chat_out.tokens == alone([1, 2], 6) and sorted(scorer._free) == [1, 2]
