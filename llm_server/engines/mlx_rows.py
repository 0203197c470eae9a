"""The MLX engine's rows: who holds which tokens, where each row's cursor is, and their KV.

Serving rows come first in one `RowStore`, the scoring rows after them; recurrent layers keep
a per-row slot in a `StateStore`. A row's cursor is the length of its token list. A fresh
prompt copies in the longest prefix held elsewhere (the prefix cache or a running row); a
released serving row gives its history to the prefix cache. A model served serially keeps
mlx-lm's own caches of its one row instead of views of the store.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from llm_server.engines.prefix_cache import PrefixCache
from llm_server.engines.row_cache import RowStore
from llm_server.engines.row_state import StateStore


class RowTable:
    """Rows and cursors: each row's tokens, KV and state, and the steps in flight on it."""

    def __init__(
        self,
        store: RowStore,
        states: StateStore,
        prefix_cache: PrefixCache,
        rows: int,
        score_rows: int,
        serial_cache: Callable[[], list] | None = None,
    ) -> None:
        """`store`/`states` hold `rows` serving rows then `score_rows` scoring rows;
        `serial_cache`: makes mlx-lm's caches of the one row (a model served serially)."""
        self.store = store
        self.states = states
        self.prefix_cache = prefix_cache
        self.rows = rows
        self.score_rows = score_rows
        self._make_serial = serial_cache
        self.serial_cache: list | None = None  # mlx-lm's caches of the one row (serial mode)
        total = rows + score_rows
        # ids whose KV each row holds; a row's cursor is the length of its list
        self.tokens: list[list[int]] = [[] for _ in range(total)]
        self.cached = [0] * total  # prompt tokens the last prefill took from the cache
        self.ahead = [0] * total  # decode steps started on a row and not yet finished
        self.epoch = [0] * total  # bumped by release(): in-flight steps are then void

    def cursor(self, row: int) -> int:
        return len(self.tokens[row])

    def check_row(self, row: int, scoring: bool = False) -> None:
        """A serving row (`scoring`: or one of the scoring rows after them)."""
        last = self.rows + (self.score_rows if scoring else 0) - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} out of range 0..{last}")

    def open(self, row: int, tokens: list[int]) -> int:
        """Reset `row` for a new prompt and copy in the longest prefix held elsewhere (prefix
        cache, or a running row); returns the positions reused (the row's cursor)."""
        self.states.clear_row(row)
        if self._make_serial is not None:
            self.serial_cache = self._make_serial()
        source, shared = self._live_prefix(row, tokens)
        entry, reused = self.prefix_cache.match(tokens, floor=shared)
        if shared > reused:  # a running row holds more of this prompt than the cache
            keys, values = self.store.read_row(source, shared)
            self.store.write_prefix(row, keys, values, shared)
            reused = shared
        elif entry is not None:
            self.store.write_prefix(row, entry.keys, entry.values, reused)
        self.prefix_cache.record(reused)
        self.tokens[row] = tokens[:reused]
        self.cached[row] = reused
        return reused

    def _live_prefix(self, row: int, tokens: list[int]) -> tuple[int, int]:
        """The other row holding the longest prefix of `tokens` (all but the last) and its
        length: the choices of an `n` > 1 request, or prompts sharing a system prompt, sent
        together. (0, 0) when none shares at least the prefix cache's minimum."""
        best_row, best = 0, 0
        if not self.prefix_cache.enabled:
            return best_row, best
        query = np.asarray(tokens[:-1], dtype=np.int64)
        for r, held in enumerate(self.tokens[: self.rows]):
            n = min(len(held), query.size)
            if r == row or n <= max(best, self.prefix_cache.min_tokens - 1):
                continue
            differ = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != query[:n])
            length = int(differ[0]) if differ.size else n
            if length > best and length >= self.prefix_cache.min_tokens:
                best_row, best = r, length
        return best_row, best

    def release(self, row: int) -> None:
        """Free `row`; a serving row's history (prompt + generated) goes to the prefix cache
        first (a scoring row's never: scoring needs the logits of every position anyway)."""
        self.check_row(row, scoring=True)
        held = self.tokens[row]
        if held and self.prefix_cache.enabled and row < self.rows:
            keys, values = self.store.read_row(row, len(held))
            self.prefix_cache.insert(held, keys, values)
        self.tokens[row] = []
        self.ahead[row] = 0
        self.epoch[row] += 1
        self.states.clear_row(row)
        self.serial_cache = None
        if not any(self.tokens):
            self.store.clear()  # idle: give the KV memory back
            mx.clear_cache()

    def rewind(self, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on: its token list, hence what the prefix
        cache gets, holds only what was kept; the KV there is overwritten by the next forward."""
        self.check_row(row)
        if not 0 <= cursor <= self.cursor(row):
            raise ValueError(f"row {row} holds {self.cursor(row)} positions, not {cursor}")
        del self.tokens[row][cursor:]

    def held(self) -> list[mx.array]:
        """Every array the rows keep between forwards (evaluated with each step)."""
        if self.serial_cache is not None:
            from mlx.utils import tree_flatten

            leaves = tree_flatten([c.state for c in self.serial_cache])
            return [a for _, a in leaves if isinstance(a, mx.array)]
        return self.store.arrays() + self.states.arrays()
