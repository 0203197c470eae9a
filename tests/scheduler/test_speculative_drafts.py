"""The pure parts of speculative decoding (no model): prompt-lookup drafts, the cost model that
sizes them, and how the planner carries them (issue 19; tests/scheduler/test_speculative.py
checks the output on the real engine).
"""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.decoding import Decoder, SamplingParams
from llm_server.engines.step import DecodeRow
from llm_server.scheduler import GenerationRequest
from llm_server.scheduler.drafting import NgramIndex, propose
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


def test_step_costs_fit_the_measured_steps() -> None:
    costs = StepCosts()
    for positions, drafted in [(1, 0), (5, 1), (9, 1), (3, 0), (2, 1), (1, 0)] * 4:
        costs.observe(positions, bool(drafted), 0.050 + 0.006 * positions + 0.002 * drafted)
    a, b, c = costs.coefficients()
    # the prior (a quarter step's worth) pulls the fit by under 10%
    assert (a, b, c) == pytest.approx((0.05, 0.006, 0.002), rel=0.1)


def test_drafts_thin_out_as_rows_fill_and_acceptance_drops() -> None:
    costs = StepCosts()
    for positions, drafted in [(1, 0), (5, 1), (9, 1), (4, 0), (20, 1), (36, 1)] * 4:
        costs.observe(positions, bool(drafted), 0.050 + 0.006 * positions + 0.002 * drafted)
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
    for _ in range(600):
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
