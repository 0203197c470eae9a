"""The batch scheduler on the real MLX engine: S2-S8, S10 (no HTTP; see tests/api for that)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from llm_server.decoding import FinishReason
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.scheduler import QueueFull, SchedulerClosed
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import PoisonEngine, make_request, serve_alone, start_scheduler


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 380, int(rng.integers(1, 90)))] for _ in range(n)]


def _wait_idle(sched, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not sched.idle():
        assert time.monotonic() < deadline, f"scheduler not idle: {sched.stats()}"
        time.sleep(0.01)


def _wait_kv_given_back(sched, timeout: float = 30.0) -> None:
    """The scheduler thread gives the idle engine's KV back once its keep-alive is over."""
    deadline = time.monotonic() + timeout
    while sched.engine.kv_bytes():
        assert time.monotonic() < deadline, "the idle KV store was never given back"
        time.sleep(0.02)


def test_staggered_requests_match_serving_each_alone(tiny_model_path, tok):
    """16 requests, varied prompts and limits, staggered, at 4 rows: identical to alone (S2/S10);
    their rows keep each finished history (reused by a later prompt sharing it), and the idle
    store goes back after the keep-alive."""
    prompts = _prompts(16)
    limits = [5 + (7 * i) % 40 for i in range(16)]
    stops = [("zz",) if i % 5 == 0 else () for i in range(16)]
    expected = [
        serve_alone(tiny_model_path, tok, p, m, stop=s)
        for p, m, s in zip(prompts, limits, stops, strict=False)
    ]

    sched = start_scheduler(tiny_model_path, 4, kv_keep_alive=0.3)
    try:
        outs, reqs = [], []
        for i, (p, m, s) in enumerate(zip(prompts, limits, stops, strict=False)):
            req, out = make_request(tok, p, m, stop=s)
            sched.submit(req)
            reqs.append(req)
            outs.append(out)
            if i % 3 == 2:
                time.sleep(0.02)  # arrivals spread over the run
        for out in outs:
            assert out.done.wait(60)
        for i, (got, want) in enumerate(zip(outs, expected, strict=False)):
            assert got.tokens == want.tokens, f"request {i} differs from serving it alone"
            assert got.text == want.text and got.reason == want.reason
        stats = sched.stats()
        assert stats.max_rows_busy == 4  # it really batched, and never beyond N
        assert list(sched.admitted) == [r.seq for r in reqs]  # the queue drained FIFO
        _wait_idle(sched)
        _wait_kv_given_back(sched)
    finally:
        sched.close(10)


def test_admission_limit_is_running_plus_queued(tiny_model_path, tok):
    """N rows + M queued are admitted at once; the next submit is refused (S3)."""
    sched = start_scheduler(tiny_model_path, 2, max_queued=3)
    try:
        with sched.acquire_lease():  # paused: nothing can finish during the burst
            admitted = []
            for p in _prompts(5):
                req, out = make_request(tok, p, 4)
                sched.submit(req)
                admitted.append(out)
            for _ in range(3):
                req, _ = make_request(tok, [5, 6], 4)
                with pytest.raises(QueueFull) as exc:
                    sched.submit(req)
                assert exc.value.retry_after > 0
            assert sched.stats().queued == 5
        for out in admitted:
            assert out.done.wait(30) and out.reason in (FinishReason.STOP, FinishReason.LENGTH)
    finally:
        sched.close(10)


def test_lone_request_on_idle_server_starts_at_once(tiny_model_path, tok):
    """Group commit (S7): one request completes without any other arriving to fill a batch."""
    sched = start_scheduler(tiny_model_path, 4)
    try:
        req, out = make_request(tok, [10, 11, 12], 3)
        sched.submit(req)
        assert out.done.wait(10)
        assert out.finish.completion_tokens == len(out.tokens) >= 1
        assert sched.stats().max_rows_busy == 1
    finally:
        sched.close(10)


def test_cancel_retires_row_before_next_step(tiny_model_path, tok):
    """A cancelled running request is not in any decode step after the one in flight (S5)."""
    sched = start_scheduler(tiny_model_path, 2, kv_keep_alive=0)
    sched.step_trace = []
    try:
        long_req, long_out = make_request(tok, [20, 21, 22], 400, ignore_eos=True)
        other_req, other_out = make_request(tok, [30, 31], 400, ignore_eos=True)
        sched.submit(long_req)
        sched.submit(other_req)
        while len(long_out.tokens) < 5:
            time.sleep(0.001)
        long_req.cancel()
        n = len(sched.step_trace)
        assert long_out.done.wait(10)
        assert long_out.reason == FinishReason.CANCELLED
        later = sched.step_trace[n + 1 :]
        assert all(long_req.seq not in step for step in later)
        other_req.cancel()
        assert other_out.done.wait(10)
        _wait_idle(sched)
        assert sched.stats().rows_busy == 0 and sched.engine.kv_bytes() == 0
    finally:
        sched.close(10)


def test_cancelled_queued_request_is_skipped(tiny_model_path, tok):
    sched = start_scheduler(tiny_model_path, 1)
    try:
        with sched.acquire_lease():
            first, first_out = make_request(tok, [5, 6, 7], 3)
            queued, queued_out = make_request(tok, [8, 9], 3)
            sched.submit(first)
            sched.submit(queued)
            queued.cancel()
        assert queued_out.done.wait(10) and queued_out.reason == FinishReason.CANCELLED
        assert queued_out.tokens == []  # never prefilled
        assert first_out.done.wait(10) and first_out.reason != FinishReason.CANCELLED
        assert queued.seq not in sched.admitted
    finally:
        sched.close(10)


def test_random_cancels_return_scheduler_to_idle(tiny_model_path, tok):
    """50 cancels at random moments (queued or running): all rows free, queue empty, no KV held."""
    sched = start_scheduler(tiny_model_path, 4, max_queued=64, kv_keep_alive=0)
    rng = random.Random(5)
    try:
        pairs = []
        for p in _prompts(60, seed=9):
            req, out = make_request(tok, p, rng.randint(1, 60), ignore_eos=True)
            sched.submit(req)
            pairs.append((req, out))
        for req, _ in rng.sample(pairs, 50):
            time.sleep(rng.random() * 0.004)
            req.cancel()
        for _, out in pairs:
            assert out.done.wait(30), "a request was lost"
        assert sum(o.reason == FinishReason.CANCELLED for _, o in pairs) >= 1
        _wait_idle(sched)
        stats = sched.stats()
        assert (stats.rows_busy, stats.queued) == (0, 0)
        assert sched.engine.kv_bytes() == 0
    finally:
        sched.close(10)


def test_lease_pauses_decoding_and_resumes(tiny_model_path, tok):
    """While a lease is held no decode step runs (S6); release resumes; errors release it."""
    sched = start_scheduler(tiny_model_path, 2)
    try:
        req, out = make_request(tok, [40, 41], 300, ignore_eos=True)
        sched.submit(req)
        while len(out.tokens) < 3:
            time.sleep(0.001)
        with sched.acquire_lease() as lease:
            steps = sched.stats().decode_steps
            held_tokens = len(out.tokens)
            assert lease.submit(lambda engine: engine.rows).result(10) == 2  # holder has the engine
            time.sleep(0.2)
            assert sched.stats().decode_steps == steps
            assert len(out.tokens) == held_tokens
        with pytest.raises(RuntimeError, match="boom"), sched.acquire_lease() as lease:
            lease.submit(lambda engine: (_ for _ in ()).throw(RuntimeError("boom"))).result(10)
        assert out.done.wait(30)  # the batch resumed after both leases
        assert out.reason == FinishReason.LENGTH and len(out.tokens) == 300
    finally:
        sched.close(10)


def test_lease_holders_are_served_in_order(tiny_model_path):
    sched = start_scheduler(tiny_model_path, 1)
    try:
        order: list[int] = []
        first = sched.acquire_lease()
        waiting = [sched.lease() for _ in range(3)]
        threads = []
        for i, lease in enumerate(waiting):

            def hold(i=i, lease=lease):
                lease.granted.result(10)
                order.append(i)
                lease.release()

            threads.append(threading.Thread(target=hold))
            threads[-1].start()
        time.sleep(0.05)
        assert order == []
        first.release()
        for t in threads:
            t.join(10)
        assert order == [0, 1, 2]
    finally:
        sched.close(10)


def test_failed_batch_forward_fails_only_its_request(tiny_model_path, tok):
    """S8: the batch is retried per request; only the poisoned request fails."""
    prompts = _prompts(3, seed=11)
    expected = [serve_alone(tiny_model_path, tok, p, 20, ignore_eos=True) for p in prompts]
    sched = start_scheduler(tiny_model_path, 4, engine_cls=PoisonEngine)
    try:
        with sched.acquire_lease():
            pairs = [make_request(tok, p, 20, ignore_eos=True) for p in prompts]
            bad_req, bad_out = make_request(tok, [PoisonEngine.POISON, 5, 6], 20)
            for req, _ in pairs[:2]:
                sched.submit(req)
            sched.submit(bad_req)
            sched.submit(pairs[2][0])
        assert bad_out.done.wait(30)
        assert bad_out.reason == FinishReason.ERROR and "out-of-memory" in bad_out.finish.error
        for (_, out), want in zip(pairs, expected, strict=False):
            assert out.done.wait(30)
            assert out.tokens == want.tokens
        assert "out-of-memory" in sched.stats().last_error
        # and the scheduler keeps serving
        req, out = make_request(tok, prompts[0], 20, ignore_eos=True)
        sched.submit(req)
        assert out.done.wait(30) and out.tokens == expected[0].tokens
    finally:
        sched.close(10)


def test_fail_all_finishes_running_and_queued_requests_with_the_error(tiny_model_path, tok):
    """A hung step (distributed/launch.py) answers every request from another thread."""
    sched = start_scheduler(tiny_model_path, 1)
    try:
        running, run_out = make_request(tok, [40, 41], 300, ignore_eos=True)
        sched.submit(running)
        while not run_out.tokens:
            time.sleep(0.001)
        with sched.acquire_lease():  # the batch is paused, as a hung step would leave it
            queued, queue_out = make_request(tok, [42], 5)
            sched.submit(queued)
            sched.fail_all("the group was lost")
            for out in (run_out, queue_out):
                assert out.done.is_set() and out.reason == FinishReason.ERROR
                assert out.finish.error == "the group was lost"
            sched.abort()
    finally:
        sched.close(10)


def test_closed_scheduler_refuses_new_work(tiny_model_path, tok):
    sched = start_scheduler(tiny_model_path, 2)
    assert sched.close(10)
    req, _ = make_request(tok, [5], 2)
    with pytest.raises(SchedulerClosed):
        sched.submit(req)


def test_seeded_sampling_is_the_same_alone_or_batched(tiny_model_path, tok):
    prompts = _prompts(4, seed=21)
    params = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
    expected = [serve_alone(tiny_model_path, tok, p, 25, **params) for p in prompts]
    sched = start_scheduler(tiny_model_path, 4)
    try:
        pairs = [make_request(tok, p, 25, **params) for p in prompts]
        for req, _ in pairs:
            sched.submit(req)
        for (_, out), want in zip(pairs, expected, strict=False):
            assert out.done.wait(30)
            assert out.tokens == want.tokens
    finally:
        sched.close(10)


def test_model_without_batching_is_served_serially_with_a_warning(
    tiny_model_path, tok, tmp_path, caplog, make_service
):
    """S1: a rows-1 export at --concurrent-requests 4 warns once and serves one at a time."""
    import asyncio
    import logging

    from converters.mlx_export import export_mlx

    serial = export_mlx(tiny_model_path, tmp_path / "rows1", rows=1)
    with caplog.at_level(logging.WARNING):
        svc = make_service(serial, concurrent=4)
    warnings = [r for r in caplog.records if "does not support batching" in r.getMessage()]
    assert len(warnings) == 1
    assert svc.scheduler.max_concurrent == 1 and not svc.batching
    prompts = _prompts(3, seed=4)
    expected = [serve_alone(tiny_model_path, tok, p, 12) for p in prompts]

    async def run_all():
        from llm_server.decoding import SamplingParams

        handles = [
            svc.start_generation(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts
        ]
        outs = []
        for h in handles:
            outs.append([ev.token_id async for ev in h.events() if hasattr(ev, "token_id")])
        return outs

    outs = asyncio.run(run_all())
    assert outs == [e.tokens for e in expected]
    assert svc.scheduler.stats().max_rows_busy == 1


def test_fingerprint_depends_on_batch_size(tiny_model_path, make_service):
    """S9: batched and serial servers report different system fingerprints."""
    one = make_service(tiny_model_path, concurrent=1)
    four = make_service(tiny_model_path, concurrent=4)
    again = make_service(tiny_model_path, concurrent=4)
    assert one.fingerprint.startswith("fp_") and one.fingerprint != four.fingerprint
    assert four.fingerprint == again.fingerprint


class _PlanRecorder(MLXEngine):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        return super().run(plan)


def test_a_lone_long_prompt_in_large_chunks_decodes_as_in_small_ones(tiny_model_path, tok):
    """Issue 38: with no row decoding a prompt runs at the prefill budget, not --step-tokens;
    greedy output is the same as with the prompt in --step-tokens chunks."""
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 380, 300)]
    got = {}
    for prefill in (16, 128):
        sched = start_scheduler(
            tiny_model_path, 2, engine_cls=_PlanRecorder, step_tokens=16, prefill_tokens=prefill
        )
        try:
            req, out = make_request(tok, prompt, 12, ignore_eos=True)
            sched.submit(req)
            assert out.done.wait(60)
            got[prefill] = out.tokens
            sizes = [c.end - c.start for p in sched.engine.plans for c in p.prefill]
        finally:
            sched.close(10)
        assert sum(sizes) == len(prompt) and max(sizes) == min(prefill, len(prompt))
    assert got[128] == got[16] and len(got[16]) == 12
