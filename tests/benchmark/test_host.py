"""llm_server/benchmark/host.py: the per-step host time is measured from the scheduler's steps."""

from __future__ import annotations

from llm_server.benchmark.host import measure


def test_host_benchmark_times_every_decode_step(tiny_model_path):
    """One row, 2 requests of 8 tokens: each request's first token comes from its prompt's
    forward, the other 7 from decode steps, so 14 decode steps are timed."""
    times = measure(tiny_model_path, concurrency=1, requests=2, max_tokens=8)
    assert times.concurrency == 1 and times.steps == 14
    assert times.step_ms > 0 and times.forward_ms > 0 and times.decoder_ms > 0
