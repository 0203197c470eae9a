"""ThinkingBudget: counts thinking tokens, forces the closing tokens at the budget, then defers
to the answer's grammar (which sees every token, forced ones included)."""

from __future__ import annotations

import numpy as np

from llm_server.decoding import LogitsConstraint
from llm_server.tools.budget import Phase, ThinkingBudget

START, END, CLOSE = [1], [2, 3], [7, 2, 3, 8]
VOCAB = 16


class Recorder(LogitsConstraint):
    """An inner grammar that bans token 15 and records what it was given."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        out[15] = -np.inf
        return out

    def advance(self, token: int) -> bool:
        self.tokens.append(token)
        return False


def _run(budget: ThinkingBudget, free: list[int]) -> list[int]:
    """Sample greedily: forced tokens when the mask leaves one, else the next of `free`."""
    out, free = [], list(free)
    logits = np.zeros(VOCAB, dtype=np.float32)
    while free or budget.phase == Phase.CLOSING:
        masked = budget.mask(logits)
        allowed = np.flatnonzero(np.isfinite(masked))
        token = int(allowed[0]) if allowed.size == 1 else free.pop(0)
        budget.advance(token)
        out.append(token)
    return out


def test_the_budget_forces_the_close_then_the_grammar_rules():
    inner = Recorder()
    b = ThinkingBudget(3, START, END, CLOSE, opened=True, inner=inner)
    out = _run(b, [10, 11, 12, 13, 14])
    assert out == [10, 11, 12, *CLOSE, 13, 14]
    assert b.phase == Phase.ANSWER and b.thought == 3
    assert inner.tokens == out  # the grammar saw the forced tokens too
    assert np.isneginf(b.mask(np.zeros(VOCAB, dtype=np.float32))[15])  # the inner mask again


def test_thinking_the_model_closes_costs_nothing():
    b = ThinkingBudget(5, START, END, CLOSE, opened=True)
    assert _run(b, [10, 2, 3, 11, 12, 13, 14]) == [10, 2, 3, 11, 12, 13, 14]
    assert b.phase == Phase.ANSWER and b.thought == 3


def test_a_model_that_opens_think_itself():
    b = ThinkingBudget(2, START, END, CLOSE, opened=False)
    assert _run(b, [9, 1, 10, 11, 12]) == [9, 1, 10, 11, *CLOSE, 12]
    plain = ThinkingBudget(2, START, END, CLOSE, opened=False)
    answer = [9, 10, 11, 12, 13, 14, 5, 6, 4]
    assert _run(plain, answer) == answer  # no <think> at the start: never forced
    assert plain.phase == Phase.ANSWER
