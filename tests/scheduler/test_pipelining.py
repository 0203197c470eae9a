"""Pipelined greedy decoding: step n+1 starts on the lazy argmax of step n; output is unchanged."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, start_scheduler


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


class SerialEngine(MLXEngine):
    """The reference: every step is started and finished before the next one is built."""

    def __init__(self, path, settings: EngineSettings) -> None:
        super().__init__(path, replace(settings, pipeline=False))


class PipelinedEngine(MLXEngine):
    """Pipelining on whatever the device (it is on by default on Metal only)."""

    def __init__(self, path, settings: EngineSettings) -> None:
        super().__init__(path, replace(settings, pipeline=True))


class WrongGuessEngine(PipelinedEngine):
    """Every step's greedy ids are off by one, so every speculation assumes the wrong token."""

    def decode_start(self, rows, tokens):
        step = super().decode_start(rows, tokens)
        step.greedy = (step.greedy + 1) % self.vocab_size
        return step


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 380, int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _serve(model, tok, engine_cls, prompts, params, concurrent=4):
    """Submit all requests at once (queued beyond `concurrent`); the outcomes and the scheduler.

    Prompt-lookup drafting is off: its steps are not pipelined, and whether a step drafts
    depends on the measured step times (spec_policy), which would make the counts of
    pipelined steps depend on the machine's speed."""
    sched = start_scheduler(
        model, concurrent, engine_cls=engine_cls, speculative="off", kv_keep_alive=0
    )
    try:
        outs = []
        for prompt, (max_tokens, kw) in zip(prompts, params, strict=True):
            req, out = make_request(tok, prompt, max_tokens, ignore_eos=True, **kw)
            sched.submit(req)
            outs.append(out)
        for out in outs:
            assert out.done.wait(120)
        assert sched.idle() and sched.engine.kv_bytes() == 0
        return outs, sched
    finally:
        sched.close(10)


@pytest.fixture(scope="module")
def reference(tiny_model_path, tok):
    prompts = _prompts(7, seed=21)
    params = [(n, {}) for n in (24, 9, 30, 17, 24, 5, 12)]
    outs, _ = _serve(tiny_model_path, tok, SerialEngine, prompts, params)
    return prompts, params, [o.tokens for o in outs]


def test_greedy_steps_are_pipelined_with_identical_output(tiny_model_path, tok, reference):
    prompts, params, want = reference
    outs, sched = _serve(tiny_model_path, tok, PipelinedEngine, prompts, params, concurrent=4)
    assert [o.tokens for o in outs] == want  # with a queue: speculation pauses for admissions
    outs, sched = _serve(tiny_model_path, tok, PipelinedEngine, prompts, params, concurrent=8)
    assert [o.tokens for o in outs] == want
    # all rows admitted at once: every step but the first and the one after each retirement
    # was started before the step before it had finished
    assert sched.speculated_steps >= sched.decode_steps - 1 - len(set(n for n, _ in params))


def test_a_wrong_speculation_is_dropped_and_output_is_unchanged(tiny_model_path, tok, reference):
    prompts, params, want = reference
    outs, sched = _serve(tiny_model_path, tok, WrongGuessEngine, prompts, params)
    assert [o.tokens for o in outs] == want
    assert sched.speculated_steps == 0 and sched.dropped_speculations > 0


def test_sampled_rows_are_not_speculated(tiny_model_path, tok):
    prompts = _prompts(3, seed=5)
    params = [(16, {}), (16, {"temperature": 0.8, "seed": 11}), (16, {})]
    want, _ = _serve(tiny_model_path, tok, SerialEngine, prompts, params)
    outs, sched = _serve(tiny_model_path, tok, PipelinedEngine, prompts, params)
    assert [o.tokens for o in outs] == [o.tokens for o in want]
    assert sched.speculated_steps == 0


def test_engine_steps_on_lazy_ids_and_cancel(tiny_model_path):
    """A step started on the lazy greedy ids of one in flight equals the synchronous steps; a
    cancelled step leaves its rows where they were; a released row ignores its old steps."""
    sync, piped = (
        MLXEngine(tiny_model_path, EngineSettings(rows=3)),
        MLXEngine(tiny_model_path, EngineSettings(rows=3)),
    )
    rng = np.random.default_rng(2)
    for row, n in enumerate((5, 12, 3)):
        prompt = rng.integers(3, 380, n).tolist()
        sync.prefill(row, prompt)
        piped.prefill(row, prompt)
    first = piped.decode_start([0, 1, 2], [7, 8, 9])
    second = piped.decode_start([0, 1, 2], first.greedy)
    a1, a2 = piped.decode_finish(first), piped.decode_finish(second)
    b1 = sync.decode([0, 1, 2], [7, 8, 9])
    b2 = sync.decode([0, 1, 2], b1.argmax(-1).tolist())
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert [piped.cursor(r) for r in range(3)] == [sync.cursor(r) for r in range(3)]

    cursors = [piped.cursor(r) for r in range(3)]
    piped.decode_cancel(piped.decode_start([0, 1, 2], [100, 101, 102]))
    assert [piped.cursor(r) for r in range(3)] == cursors
    np.testing.assert_array_equal(
        piped.decode([0, 1, 2], [4, 5, 6]), sync.decode([0, 1, 2], [4, 5, 6])
    )

    step = piped.decode_start([1, 2], [1, 2])
    with pytest.raises(RuntimeError, match="in flight"):
        piped.prefill(1, [3, 4])
    piped.release(1)
    piped.decode_finish(step)
    assert piped.cursor(1) == 0 and piped.cursor(2) == cursors[2] + 2


def test_cancel_while_a_step_is_speculated_admits_the_next_request(tiny_model_path, tok):
    """The lone greedy row is cancelled while its next step is in flight and a request waits:
    the speculation is dropped and the waiting request is served (no stall)."""
    sched = start_scheduler(tiny_model_path, 1, engine_cls=PipelinedEngine)
    try:
        for attempt in range(5):
            first, first_out = make_request(tok, [20, 21, 22], 400, ignore_eos=True)
            sched.submit(first)
            while len(first_out.tokens) < 3 + attempt:
                time.sleep(0.001)
            second, second_out = make_request(tok, [30, 31], 4, ignore_eos=True)
            first.cancel()
            sched.submit(second)
            assert first_out.done.wait(10) and second_out.done.wait(10)
            assert len(second_out.tokens) == 4
        assert sched.speculated_steps > 0
    finally:
        sched.close(10)


def test_a_thread_that_ends_after_steps_leaves_nothing_computing(default_model_path):
    """MLX aborts the process ("terminate called without an active exception") when a thread
    that made CPU streams ends with work still queued on them; finish and cancel must wait.
    SmolLM2, so that eight chained steps are still computing when they are cancelled."""
    code = f"""
import threading
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings

def work():
    engine = MLXEngine({str(default_model_path)!r}, EngineSettings(rows=2, prefix_cache_bytes=0))
    engine.prefill(0, [5, 6, 7])
    engine.prefill(1, [8, 9])
    engine.decode([0, 1], [1, 2])
    steps = [engine.decode_start([0, 1], [3, 4])]
    for _ in range(7):
        steps.append(engine.decode_start([0, 1], steps[-1].greedy))
    engine.decode_finish(steps[0])
    for step in reversed(steps[1:]):
        engine.decode_cancel(step)
    assert engine.cursor(0) == 5 and engine.cursor(1) == 4, (engine.cursor(0), engine.cursor(1))
    engine.thread_exit()

thread = threading.Thread(target=work)
thread.start()
thread.join()
print("ok")
"""
    _runs_clean(code)


def test_a_closed_scheduler_thread_leaves_the_process_able_to_exit(tiny_model_path):
    """Its split streams are finished and destroyed when the scheduler thread ends (the abort
    at exit hit one run in two before; four clean runs in a row)."""
    code = f"""
from llm_server.decoding import Decoder, SamplingParams
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler import BatchScheduler, GenerationRequest
from llm_server.tokenizer import Tokenizer

tok = Tokenizer({str(tiny_model_path)!r})
sched = BatchScheduler(lambda: MLXEngine({str(tiny_model_path)!r}, EngineSettings(rows=2)), 2).start()
sched.wait_ready(60)
events = []
for prompt in ([5, 6, 7], [8, 9]):
    decoder = Decoder(SamplingParams(max_tokens=8, temperature=0.0), tok.eos_token_ids, tok.decode)
    sched.submit(GenerationRequest(prompt=prompt, decoder=decoder, emit=events.append))
assert sched.close(60)
print("ok")
"""
    for _ in range(4):
        _runs_clean(code)


def _runs_clean(code: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
