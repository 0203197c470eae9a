"""A thinking budget: after `budget` thinking tokens, force the `</think>` that ends the thinking.

A per-row logits constraint wrapped around the answer's own grammar (or none): while the model
thinks it only counts; when the count reaches the budget it forces the closing text token by
token (the grammar, which takes any thinking text up to `</think>`, sees the same tokens), then
leaves the answer to the grammar. Thinking the model closes itself costs nothing more.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from llm_server.decoding import LogitsConstraint

# tokens the model may write before it opens <think> itself (whitespace, a stray newline)
OPEN_WINDOW = 4


class Phase(enum.Enum):
    BEFORE = "before"  # the model may still open <think> itself
    THINKING = "thinking"
    CLOSING = "closing"  # forcing the closing tokens
    ANSWER = "answer"


class ThinkingBudget(LogitsConstraint):
    """Ends the thinking after `budget` tokens by forcing `close` (e.g. "\\n</think>\\n\\n").

    `start`/`end`: the token ids of `<think>` and `</think>`; `opened`: the prompt already
    opened the thinking. `inner`: the grammar of the rest of the answer (None: free).
    """

    def __init__(
        self,
        budget: int,
        start: Sequence[int],
        end: Sequence[int],
        close: Sequence[int],
        opened: bool,
        inner: LogitsConstraint | None = None,
    ) -> None:
        if budget < 1 or not start or not end or not close:
            raise ValueError("a thinking budget needs a positive budget and marker token ids")
        self.budget = budget
        self.start, self.end, self.close = list(start), list(end), list(close)
        self.inner = inner
        self.phase = Phase.THINKING if opened else Phase.BEFORE
        self.thought = 0  # tokens generated while thinking
        self._seen: list[int] = []  # generated ids (only the tail is read)
        self._forced = 0  # closing tokens forced so far

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [vocab] -> the one closing token while closing, else the inner mask."""
        if self.phase == Phase.CLOSING:
            out = np.full_like(logits, -np.inf)
            token = self.close[self._forced]
            out[token] = logits[token]
            return out
        return self.inner.mask(logits) if self.inner is not None else logits

    def accepting(self) -> bool:
        return self.inner is None or self.inner.accepting()

    def advance(self, token: int) -> bool:
        done = self.inner.advance(token) if self.inner is not None else False
        self._seen.append(int(token))
        if self.phase == Phase.CLOSING:
            self._forced += 1
            if self._forced == len(self.close):
                self.phase = Phase.ANSWER
        elif self.phase == Phase.BEFORE:
            if self._ends_with(self.start):
                self.phase, self.thought = Phase.THINKING, 0
            elif len(self._seen) > len(self.start) + OPEN_WINDOW:
                self.phase = Phase.ANSWER  # the model answers without thinking
        elif self.phase == Phase.THINKING:
            self.thought += 1
            if self._ends_with(self.end):
                self.phase = Phase.ANSWER
            elif self.thought >= self.budget:
                self.phase = Phase.CLOSING
        return done

    def _ends_with(self, ids: list[int]) -> bool:
        return self._seen[-len(ids) :] == ids
