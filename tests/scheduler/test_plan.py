"""plan() and the step loop on a fake engine that executes plans: admission, budget, fairness,
cancellation, pumps and leases; no MLX, no threads, no sleeps (the scheduler's `step()` is
driven on the test thread). Scoring chunks in the plan: test_plan_scoring.py."""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.decoding import FinishReason
from llm_server.scheduler.planner import plan
from tests.scheduler.fakes import alone, drain, request, scheduler

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


def test_each_newcomer_opens_on_the_row_the_engine_prefers_among_those_left():
    reqs = [request([5] * n)[0] for n in (3, 4, 5)]
    asked = []

    def row_for(prompt: list[int], rows: list[int]) -> int:
        asked.append((len(prompt), list(rows)))
        return rows[-1]  # e.g. the row still holding this prompt's prefix

    p = plan(reqs, {}, [2, 0, 1], budget=0, row_for=row_for)
    assert [(a.seq, a.row) for a in p.admit] == [
        (reqs[0].seq, 2),
        (reqs[1].seq, 1),
        (reqs[2].seq, 0),
    ]
    assert asked == [(3, [0, 1, 2]), (4, [0, 1]), (5, [0])]


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


def test_a_lone_prompt_runs_at_the_prefill_budget_and_beside_decoding_rows_at_the_step_budget():
    long, _ = request(list(range(3, 3003)))
    p = plan([long], {}, [0], budget=128, prefill_budget=1024)
    assert [(c.row, c.start, c.end) for c in p.prefill] == [(0, 0, 1024)]
    long.row, long.prefilled = 0, 1024  # in its prompt, nobody decoding: the prefill budget
    p = plan([], {0: long}, [1], budget=128, prefill_budget=1024)
    assert [(c.start, c.end) for c in p.prefill] == [(1024, 2048)]
    runner, _ = request([1, 2])
    runner.row, runner.prefilled, runner.last_token = 1, 2, 9
    p = plan([], {0: long, 1: runner}, [], budget=128, prefill_budget=1024)
    assert [(c.start, c.end) for c in p.prefill] == [(1024, 1151)] and p.tokens == 128
    p = plan([], {0: long}, [1], budget=128, prefill_budget=0)  # 0: the whole rest
    assert [(c.start, c.end) for c in p.prefill] == [(1024, 3000)]
    p = plan([], {0: long}, [1], budget=128, prefill_budget=64)  # never below --step-tokens
    assert [(c.start, c.end) for c in p.prefill] == [(1024, 1152)]
    p = plan([], {0: long}, [1], budget=0, prefill_budget=1024)  # --step-tokens 0: unlimited
    assert [(c.start, c.end) for c in p.prefill] == [(1024, 3000)]


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


def test_a_lone_long_prompt_runs_in_large_chunks_and_a_newcomer_beside_it_in_small_ones():
    sched = scheduler(2, 32, prefill_tokens=256)
    first, first_out = request(list(range(1, 61)) * 10, 30)  # 600 tokens, nobody decoding
    sched.submit(first)
    plans = [sched.step() for _ in range(3)]
    assert [[(c.start, c.end) for c in p.prefill] for p in plans] == [
        [(0, 256)],
        [(256, 512)],
        [(512, 600)],
    ]
    assert len(first_out.tokens) == 1
    second, second_out = request(list(range(2, 52)) * 2, 3)  # 100 tokens beside a decoding row
    sched.submit(second)
    plans = drain(sched)
    chunks = [(p, c) for p in plans for c in p.prefill]
    assert [(c.start, c.end) for _, c in chunks] == [(0, 31), (31, 62), (62, 93), (93, 100)]
    assert all(p.tokens <= 32 and len(p.decode) == 1 for p, _ in chunks)  # never stalled past 32
    assert first_out.tokens == alone(list(range(1, 61)) * 10, 30)
    assert second_out.tokens == alone(list(range(2, 52)) * 2, 3)


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
