"""The pure parts of speculative decoding (no model): prompt-lookup drafts, the cost model that
sizes them, and how the planner carries them (issue 19; tests/scheduler/test_speculative.py
checks the output on the real engine).
"""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.decoding import Decoder, SamplingParams
from llm_server.engines.plan import DecodeRow
from llm_server.scheduler import GenerationRequest
from llm_server.scheduler.draft_state import NgramIndex, propose
from llm_server.scheduler.planner import plan
from llm_server.scheduler.spec_policy import Acceptance, StepCosts


def test_propose_takes_the_latest_longest_match() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == (7, 8, 1)
    assert propose([5, 6, 1, 2, 3, 4, 9, 3], 2) == (4, 9)  # falls back to a 1-gram
    assert propose([1, 2, 3, 4], 4) == ()  # nothing repeats
    assert propose([1, 2, 1, 2], 0) == ()


def test_the_index_follows_the_tokens_as_a_scan_would() -> None:
    """The incremental index proposes what a right-to-left scan of the whole history does."""

    def scan(tokens, k):
        for n in range(min(3, len(tokens) - 1), 0, -1):
            tail = tokens[len(tokens) - n :]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tail:
                    return tuple(tokens[i + n : i + n + k])
        return ()

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 6, 300).tolist()
    index = NgramIndex(tokens[:20])
    for j in range(20, 300):
        assert index.propose(4)[0] == scan(tokens[:j], 4)
        index.extend([tokens[j]])


def _steps(costs: StepCosts, a: float, r: float, d: float, c: float) -> None:
    """Decode steps of several shapes (rows, draft ids) costing a + r*rows + d*ids + c."""
    shapes = [(1, 0), (1, 4), (1, 8), (4, 0), (4, 16), (4, 32), (2, 0), (3, 0), (2, 3)]
    for rows, ids in shapes * 4:
        costs.observe(rows, ids, a + r * rows + d * ids + (c if ids else 0.0))


def test_step_costs_fit_the_measured_steps() -> None:
    costs = StepCosts()
    _steps(costs, 0.050, 0.006, 0.0013, 0.020)
    # the prior (a quarter step's worth) pulls the fit by under 20%
    assert costs.coefficients() == pytest.approx((0.05, 0.006, 0.0013, 0.020), rel=0.2)
    assert costs.report()["fit_ms"] == pytest.approx(
        {"a": 50.0, "r": 6.0, "d": 1.3, "c": 20.0}, rel=0.2
    )


def test_a_draft_pays_for_the_drafted_step_not_for_a_row() -> None:
    """Issue 38: on the CPU a row costs ~10 ms, a draft id ~1.3 ms and a drafted step ~20 ms
    more; a short draft must make more than those 20 ms, a long one is not charged per row."""
    costs = StepCosts()
    _steps(costs, 0.030, 0.010, 0.0013, 0.020)
    # four rows: 4 tokens per 70 ms; 2 ids at 0.6 expect 0.96 tokens, the step costs 22.6 ms
    # (1.3 tokens' worth): not worth it
    assert costs.lengths(4, {0: (0.6, 2)}) == {}
    # 8 ids at 0.9 expect ~5.1 tokens for 30 ms: worth it, all 8 (0.9^8 = 0.43 beats 0.074)
    assert costs.lengths(4, {0: (0.9, 8)}) == {0: 8}
    # two rows drafting together share the 20 ms
    assert costs.lengths(4, {0: (0.75, 8), 1: (0.75, 8)}) == {0: 8, 1: 8}
    assert costs.lengths(4, {0: (0.75, 8)}) == {0: 8}
    assert costs.lengths(4, {0: (0.5, 8)}) == {}


def test_the_draft_cost_is_kept_while_nothing_drafts() -> None:
    """Issue 38: a long run of plain steps (drafting stopped because it did not pay) must not
    make the model forget what a drafted step costs, or drafting resumes at that cost."""
    costs = StepCosts()
    _steps(costs, 0.030, 0.010, 0.0013, 0.020)
    for _ in range(300):
        costs.observe(4, 0, 0.070)
    a, r, d, c = costs.coefficients()
    assert a + 4 * r == pytest.approx(0.070, rel=0.01)
    assert (d, c) == pytest.approx((0.0013, 0.020), rel=0.2)
    assert costs.lengths(4, {0: (0.6, 2)}) == {}


def test_drafts_thin_out_as_rows_fill_and_acceptance_drops() -> None:
    costs = StepCosts()
    _steps(costs, 0.050, 0.006, 0.006, 0.0)  # no cost of its own to a drafted step
    # one row: a position costs 0.006 s of 0.056 s per plain token, so p > 0.107 pays
    assert costs.lengths(1, {0: (0.9, 8)}) == {0: 8}
    assert costs.lengths(1, {0: (0.5, 8)}) == {0: 3}  # 0.5^3 = 0.125, 0.5^4 = 0.0625
    # four rows: 4 tokens per 0.074 s, so a position must be kept with p > 0.324
    assert costs.lengths(4, {r: (0.5, 8) for r in range(4)}) == {r: 1 for r in range(4)}
    assert costs.lengths(4, {0: (0.9, 8), 1: (0.3, 8)}) == {0: 8}
    assert costs.lengths(4, {0: (0.3, 8)}) == {}
    # a row whose drafts all fail falls under the bar, then its record fades and it retries
    row = Acceptance()
    for _ in range(3):
        row.note(4, 0, 0.5)
    assert costs.lengths(4, {0: (row.rate(0.5), 4)}) == {}
    for _ in range(200):
        row.tick()
    assert costs.lengths(4, {0: (row.rate(0.5), 4)}) == {0: 1}
    # a source that fell under the bar is tried again once its record has faded
    for _ in range(5):
        costs.note("ngram1", 4, 0)
    assert costs.lengths(4, {0: (costs.source_rate("ngram1"), 4)}) == {}
    for _ in range(1000):
        costs.tick()
    assert costs.lengths(4, {0: (costs.source_rate("ngram1"), 4)}) == {0: 1}
    # a row that keeps more than its source's rate is trusted more than the source
    good = Acceptance()
    good.note(4, 4, 0.5)
    assert good.rate(0.5) == pytest.approx(0.5 * 5 / 3) and good.rate(0.9) == 0.99


def test_plan_carries_drafts_and_counts_them_in_the_budget() -> None:
    def req(prompt, last):
        r = GenerationRequest(prompt, Decoder(SamplingParams(9, 0.0), frozenset(), str), print)
        r.prefilled, r.last_token = len(prompt), last
        return r

    running = {0: req([1, 2], 5), 1: req([3, 4], 6)}
    step = plan([], running, [], budget=8, drafts={1: (7, 8, 9)})
    assert step.decode == (DecodeRow(0, 5), DecodeRow(1, 6, (7, 8, 9)))
    assert step.tokens == 5
