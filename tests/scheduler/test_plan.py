"""plan() and the step loop on a fake engine that executes plans: admission, budget, fairness,
cancellation, scoring and leases; no MLX, no threads, no sleeps (the scheduler's `step()` is
driven on the test thread)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llm_server.decoding import Decoder, FinishReason, SamplingParams
from llm_server.engines.base import SCORE_CHUNK, EngineError
from llm_server.engines.step import ScoreChunkResult, StepPlan, StepResult
from llm_server.scheduler import BatchScheduler, FinishEvent, GenerationRequest, TokenEvent
from llm_server.scheduler.planner import plan
from llm_server.scheduler.scorer import Scorer

VOCAB = 64
EOS = 0


class FakeEngine:
    """Executes plans over per-row token lists; a row's next-token logits are a function of its
    own history alone, so a request's greedy output does not depend on its neighbours."""

    name = "fake"
    dynamic_shapes = True
    padded_shapes = False
    pipelined = False
    serial_reason = None
    dtype = "float32"
    vocab_size = VOCAB

    def __init__(
        self, rows: int, context_length: int = 4096, share_min: int = 0, score_rows: int = 0
    ) -> None:
        self.rows = rows
        self.score_rows = score_rows  # scoring rows after the serving rows
        self.context_length = context_length
        self.shared_prefix_min = share_min
        self.held: list[list[int]] = [[] for _ in range(rows + score_rows)]
        self.plans: list[StepPlan] = []  # every plan run, in order
        self.fail_rows: set[int] = set()  # forwards touching these rows raise

    def run(self, plan: StepPlan) -> StepResult:
        touched = {d.row for d in plan.decode} | {c.row for c in plan.prefill}
        if touched & self.fail_rows or any(c.prompt[0] in self.fail_rows for c in plan.score):
            raise EngineError("simulated failure")
        self.plans.append(plan)
        rows, logits, cursors, cached = [], [], {}, {}
        for d in plan.decode:
            assert self.held[d.row], f"decode on empty row {d.row}"
            self.held[d.row].append(d.token)
            rows.append(d.row)
            logits.append(self._logits(d.row))
        for c in plan.prefill:
            if c.fresh:
                self.held[c.row] = []
                cached[c.row] = 0
            assert len(self.held[c.row]) == c.start
            self.held[c.row] += list(c.prompt[c.start : c.end])
            cursors[c.row] = c.end
            if c.end == len(c.prompt):
                rows.append(c.row)
                logits.append(self._logits(c.row))
        scores = {}
        for c in plan.score:
            assert c.row >= self.rows and (c.start == 0 or len(self.held[c.row]) == c.start)
            self.held[c.row] = self.held[c.row][: c.start] + list(c.prompt[c.start : c.end])
            scores[c.row] = fake_scores(c.prompt, c.start, c.end, c.top_k)
        return StepResult(
            tuple(rows),
            np.array(logits, np.float32).reshape(-1, VOCAB),
            cursors,
            cached,
            scores=scores,
        )

    def _logits(self, row: int) -> np.ndarray:
        h = self.held[row]
        out = np.zeros(VOCAB, np.float32)
        out[1 + (sum(h) * 7 + len(h)) % (VOCAB - 1)] = 1.0  # never EOS
        return out

    def cursor(self, row: int) -> int:
        return len(self.held[row])

    def cached_tokens(self, row: int) -> int:
        return 0

    def release(self, row: int) -> None:
        self.held[row] = []

    def prefill(self, row, tokens):
        self.held[row] = list(tokens)
        return self._logits(row)

    def decode(self, rows, tokens):
        for r, t in zip(rows, tokens, strict=True):
            self.held[r].append(t)
        return np.stack([self._logits(r) for r in rows])

    def thread_exit(self) -> None:
        pass


def fake_scores(prompt, start: int, end: int, k: int) -> ScoreChunkResult:
    """Log-probs of positions start..end-1 [1, q], each a function of the prompt up to it."""
    lp = [-((sum(prompt[: i + 1]) * 7 + i) % 13) / 4 for i in range(start, end)]
    ids = [(sum(prompt[: i + 1]) % (VOCAB - 1)) + 1 for i in range(start, end)]
    return ScoreChunkResult(
        token_logprobs=np.array([lp], np.float32),
        top_ids=np.array([[[t] * k for t in ids]], np.int32).reshape(1, end - start, k),
        top_logprobs=np.array([[[v] * k for v in lp]], np.float32).reshape(1, end - start, k),
        greedy_ids=np.array([ids], np.int32),
    )


class Out:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None

    def emit(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev.token_id)
        else:
            self.finish = ev


def request(prompt: list[int], max_tokens: int = 4, **kw) -> tuple[GenerationRequest, Out]:
    out = Out()
    dec = Decoder(SamplingParams(max_tokens=max_tokens, temperature=0.0), frozenset({EOS}), str)
    return GenerationRequest(prompt=prompt, decoder=dec, emit=out.emit, **kw), out


def scheduler(rows: int, step_tokens: int, scorer: Scorer | None = None, **kw) -> BatchScheduler:
    sched = BatchScheduler(
        lambda: FakeEngine(rows, **kw), max_concurrent=rows, max_queued=64, step_tokens=step_tokens
    )
    sched.scorer = scorer
    sched.load()
    return sched


def drain(sched: BatchScheduler, limit: int = 1000) -> list[StepPlan]:
    plans = []
    while not sched.idle() or (sched.scorer is not None and sched.scorer.pending()):
        plans.append(sched.step())
        assert len(plans) < limit
    return plans


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    sched = scheduler(1, 0)
    req, out = request(prompt, max_tokens)
    sched.submit(req)
    drain(sched)
    return out.tokens


# -- plan() alone ------------------------------------------------------------------


def test_fifo_admission_into_the_lowest_free_rows():
    reqs = [request([5] * n)[0] for n in (3, 4, 5)]
    p = plan(reqs, {}, [2, 0, 1], budget=0)
    assert [(a.seq, a.row) for a in p.admit] == [
        (reqs[0].seq, 0),
        (reqs[1].seq, 1),
        (reqs[2].seq, 2),
    ]
    assert [(c.row, c.start, c.end) for c in p.prefill] == [(0, 0, 3), (1, 0, 4), (2, 0, 5)]
    assert p.decode == () and p.retire == () and p.drop == ()


def test_budget_counts_decode_rows_and_splits_the_newcomer():
    running = {}
    for row in range(7):
        req, _ = request([1, 2])
        req.row, req.prefilled, req.last_token = row, 2, 9
        running[row] = req
    newcomer, _ = request(list(range(3, 103)))
    p = plan([newcomer], running, [7], budget=32)
    assert [d.row for d in p.decode] == list(range(7))
    assert [(c.seq, c.row, c.start, c.end) for c in p.prefill] == [(newcomer.seq, 7, 0, 25)]
    assert p.tokens == 32


def test_a_prompt_in_progress_goes_before_newcomers_and_the_head_is_never_skipped():
    long, _ = request(list(range(3, 203)))
    long.row, long.prefilled = 0, 40
    short, _ = request([7, 8])
    p = plan([short], {0: long}, [1], budget=64)
    assert [(c.row, c.start, c.end) for c in p.prefill] == [(0, 40, 104)]
    assert p.admit == ()  # nothing left for the short one: it waits at the head
    p = plan([short], {0: long}, [1], budget=200)
    assert [(c.row, c.start, c.end) for c in p.prefill] == [(0, 40, 200), (1, 0, 2)]


def test_cancelled_rows_retire_and_cancelled_queued_requests_drop():
    run, _ = request([1, 2])
    run.row, run.prefilled, run.last_token = 3, 2, 5
    run.cancelled.set()
    gone, _ = request([4])
    gone.cancelled.set()
    waiting, _ = request([6, 7])
    p = plan([gone, waiting], {3: run}, [], budget=16)
    assert p.retire == (3,) and p.drop == (gone.seq,)
    assert p.decode == ()
    assert [(a.seq, a.row) for a in p.admit] == [(waiting.seq, 3)]  # the retired row is reused


def test_no_admission_while_a_pipelined_step_is_in_flight_and_pump_flag():
    waiting, _ = request([6, 7])
    p = plan([waiting], {}, [0], budget=16, admit=False, pump=True)
    assert p.admit == () and p.prefill == () and p.pump


def test_a_newcomer_waits_a_step_to_copy_a_shared_prefix():
    system = list(range(10, 60))
    first, _ = request(system + [1])
    second, _ = request(system + [2])
    p = plan([first, second], {}, [0, 1], budget=256, share_min=16)
    assert [a.seq for a in p.admit] == [first.seq]  # the second would copy nothing yet
    first.row, first.prefilled, first.last_token = 0, len(first.prompt), 4
    p = plan([second], {0: first}, [1], budget=256, share_min=16)
    assert [a.seq for a in p.admit] == [second.seq]
    assert plan([first, second], {}, [0, 1], budget=256).admit[1].seq == second.seq  # off: no wait


# -- the step loop on the fake engine -----------------------------------------------


def test_every_step_respects_the_budget_and_output_equals_alone():
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 60, int(n)).tolist() for n in rng.integers(1, 150, 12)]
    limits = [int(n) for n in rng.integers(1, 20, 12)]
    sched = scheduler(4, 48)
    outs = []
    for p, m in zip(prompts, limits, strict=True):
        req, out = request(p, m)
        sched.submit(req)
        outs.append(out)
    plans = drain(sched)
    assert all(p.tokens <= 48 for p in plans)
    assert any(p.decode and p.prefill for p in plans)  # chunks rode with decoding rows
    for out, p, m in zip(outs, prompts, limits, strict=True):
        assert out.tokens == alone(p, m)
        assert out.finish.reason == FinishReason.LENGTH and out.finish.completion_tokens == m
    assert sched.max_rows_busy == 4 and sorted(sched._free) == [0, 1, 2, 3]


def test_a_long_prompt_is_split_over_steps_while_the_others_decode():
    sched = scheduler(4, 32)
    runners = []
    for i in range(3):
        req, out = request([i + 1] * 5, 50)
        sched.submit(req)
        runners.append(out)
    sched.step()  # the three short prompts, all in one forward
    long, long_out = request(list(range(1, 61)) * 2, 3)  # 120 tokens
    sched.submit(long)
    ranges = []
    while long.prefilled < 120:
        p = sched.step()
        assert len(p.decode) == 3 and p.tokens <= 32
        ranges += [(c.start, c.end) for c in p.prefill]
        assert long_out.tokens == [] or long.prefilled == 120
    assert ranges == [(0, 29), (29, 58), (58, 87), (87, 116), (116, 120)]
    assert len(long_out.tokens) == 1  # sampled once, from the last chunk
    drain(sched)
    assert long_out.tokens == alone(list(range(1, 61)) * 2, 3)


def test_a_cancelled_row_is_gone_from_the_next_plan():
    sched = scheduler(2, 64)
    a, a_out = request([1, 2, 3], 30)
    b, _ = request([4, 5], 30)
    sched.submit_all([a, b])
    sched.step()
    assert {d.row for d in sched.step().decode} == {0, 1}
    a.cancel()
    p = sched.step()
    assert p.retire == (a.row,) and [d.row for d in p.decode] == [b.row]
    assert a_out.finish.reason == FinishReason.CANCELLED
    assert [d.row for d in sched.step().decode] == [b.row]


def test_a_failed_forward_fails_only_its_request():
    sched = scheduler(3, 64)
    outs = []
    for p in ([1, 2], [3, 4], [5, 6]):
        req, out = request(p, 5)
        sched.submit(req)
        outs.append(out)
    sched.engine.fail_rows = {1}
    drain(sched)
    assert outs[1].finish.reason == FinishReason.ERROR and "simulated" in outs[1].finish.error
    assert [o.tokens for o in (outs[0], outs[2])] == [alone([1, 2], 5), alone([5, 6], 5)]


def test_zero_budget_runs_whole_prompts_in_the_admitting_step():
    sched = scheduler(2, 0)
    req, out = request(list(range(1, 50)) * 20, 2)  # 980 tokens
    sched.submit(req)
    p = sched.step()
    assert [(c.start, c.end) for c in p.prefill] == [(0, 980)] and len(out.tokens) == 1


class Pump:
    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.ran: list[int] = []  # decode steps done when each batch ran

    def pending(self) -> bool:
        return self.batches > 0

    def run_batch(self, engine) -> None:
        self.batches -= 1
        self.ran.append(len(engine.plans))


def test_a_pump_runs_one_batch_per_step_and_waits_for_leases():
    sched = scheduler(2, 64)
    sched.pump = Pump(3)
    req, _ = request([1, 2, 3], 10)
    sched.submit(req)
    lease = sched.lease()

    def holder(engine) -> int:  # runs on the stepping thread while the batch is paused
        lease.release()
        return len(engine.plans)

    seen = lease.submit(holder)
    p = sched.step()  # the lease is served first; the step then runs, scoring after it
    assert seen.result(0) == 0 and p.pump and sched.pump.ran == [1]
    sched.step()
    sched.step()
    assert sched.pump.ran == [1, 2, 3]
    assert not sched.step().pump


@pytest.mark.parametrize("budget", [0, 16])
def test_exclusive_requests_run_alone_before_the_step(budget):
    sched = scheduler(2, budget)
    other, other_out = request([1, 2], 6)
    sched.submit(other)
    sched.step()
    excl, excl_out = request([3, 4, 5], 4, exclusive=True)
    sched.submit(excl)
    p = sched.step()
    assert [a.exclusive for a in p.admit] == [True]
    assert len(excl_out.tokens) == 4 and excl_out.finish is not None  # done within the step
    assert len(other_out.tokens) == 2  # the batch moved one step only
    drain(sched)
    assert excl_out.tokens == alone([3, 4, 5], 4) and other_out.tokens == alone([1, 2], 6)


# -- scoring chunks in the plan (the engine's scoring rows) ---------------------------


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
