"""A request whose prompt's KV the memory budget refuses waits for room, queued and holding
no row (BatchScheduler._park), on the fake engine: it runs once a row is freed, exactly as
alone (S8), fails with the budget's error past `memory_wait`, and never busy-loops."""

from __future__ import annotations

import threading
import time

from llm_server.decoding import FinishReason
from llm_server.engines.contract import EngineError
from llm_server.engines.kv.budget import REFUSED
from llm_server.scheduler import BatchScheduler

from .fakes import FakeEngine, alone, drain, request


class OneRowOfRoom(FakeEngine):
    """Room for one row's KV at a time: opening a row while another holds tokens is refused
    as the memory budget refuses it (the step fails before it runs)."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.calls = 0  # every `run`, refused ones included

    def run(self, plan):
        self.calls += 1
        fresh = [c.row for c in plan.prefill if c.fresh]
        for c in plan.prefill:
            others = [r for r, h in enumerate(self.held) if h and r != c.row]
            if c.fresh and (others or fresh.index(c.row) > 0):
                raise EngineError(f"forward failed: {REFUSED} the KV store's growth needs more")
        return super().run(plan)


def _scheduler(memory_wait: float) -> BatchScheduler:
    sched = BatchScheduler(
        lambda: OneRowOfRoom(2), max_concurrent=2, step_tokens=8, memory_wait=memory_wait
    )
    sched.load()
    return sched


def test_a_request_refused_room_runs_once_the_other_finishes_exactly_as_alone():
    sched = _scheduler(memory_wait=60.0)
    a, out_a = request([1, 2, 3, 4, 5], max_tokens=6)
    b, out_b = request([9, 8, 7, 6], max_tokens=5)
    sched.submit_all([a, b])
    plans = drain(sched)
    assert out_a.finish.reason is not FinishReason.ERROR
    assert out_b.finish.reason is not FinishReason.ERROR
    assert out_a.tokens == alone([1, 2, 3, 4, 5], 6) and out_b.tokens == alone([9, 8, 7, 6], 5)
    assert sched.memory_waits == 1  # b waited once, retried when a's row was freed
    assert len(plans) < 40 and sched.stats().rows_busy == 0 and sorted(sched._free) == [0, 1]
    assert list(sched.admitted)[-3:] == [a.seq, b.seq, b.seq]


def test_past_its_wait_a_request_refused_room_fails_with_the_budget_error():
    sched = _scheduler(memory_wait=0.0)  # no wait: today's 503 at once
    a, out_a = request([1, 2, 3, 4, 5], max_tokens=6)
    b, out_b = request([9, 8, 7, 6], max_tokens=5)
    sched.submit_all([a, b])
    drain(sched)
    assert out_a.finish.reason is not FinishReason.ERROR
    assert out_b.finish.reason is FinishReason.ERROR and REFUSED in out_b.finish.error
    assert sched.memory_waits == 0 and sorted(sched._free) == [0, 1]


def test_a_request_waiting_for_room_does_not_busy_loop():
    sched = BatchScheduler(lambda: OneRowOfRoom(2), max_concurrent=2, memory_wait=0.4)
    sched.start()
    engine = sched.wait_ready(30)
    engine.held[1] = [5, 5, 5]  # room held by something that never finishes
    done = threading.Event()
    b, out_b = request([9, 8, 7, 6], max_tokens=5)
    b.emit = lambda ev, emit=b.emit: (emit(ev), out_b.finish and done.set())
    t0 = time.monotonic()
    sched.submit(b)
    assert done.wait(30)
    assert time.monotonic() - t0 >= 0.4
    assert out_b.finish.reason is FinishReason.ERROR and REFUSED in out_b.finish.error
    assert engine.calls <= 4  # refused (the step, then alone), once more at its deadline
    assert sched.close(10)
