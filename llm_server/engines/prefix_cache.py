"""Prompt prefix cache: KV of token prefixes the engine already computed, bounded in bytes.

Entries are token sequences with their keys/values for every layer ([positions, heads, dim]).
A new prompt reuses the longest prefix it shares with any entry; the least recently used
entries are evicted so the total never exceeds the byte bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class PrefixEntry:
    tokens: np.ndarray  # [n] int32
    keys: list[mx.array]  # per layer [kv_heads, n, dim]
    values: list[mx.array]
    nbytes: int


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int
    hit_tokens: int
    lookups: int
    entries: int
    bytes: int
    max_bytes: int


class PrefixCache:
    """LRU of prompt prefixes; `match` finds reusable KV, `insert` stores a row's history."""

    def __init__(
        self, max_bytes: int, min_tokens: int = 4, layers: tuple[int, int] = (1, 1)
    ) -> None:
        """`layers`: (counted, held): bytes are counted as if the entries held `counted`
        layers where they hold `held` (a pipeline stage, whose eviction must match every
        other rank's)."""
        if max_bytes < 0:
            raise ValueError("prefix cache bytes must be >= 0")
        self.max_bytes = max_bytes
        self._counted, self._held = layers
        self.min_tokens = min_tokens  # shorter matches are not worth a copy
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_id = 0
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0
        self.lookups = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def match(self, tokens: list[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that length (< len(tokens))."""
        if not self.enabled or not self._entries:
            return None, 0
        self.lookups += 1
        query = np.asarray(tokens, dtype=np.int32)
        best, best_len, best_id = None, 0, None
        for eid, entry in self._entries.items():
            n = min(len(entry.tokens), len(query) - 1)  # keep one token to compute logits from
            if n <= best_len:
                continue
            same = entry.tokens[:n] == query[:n]
            length = n if same.all() else int(np.argmin(same))
            if length > best_len:
                best, best_len, best_id = entry, length, eid
        if best is None or best_len < self.min_tokens:
            return None, 0
        self._entries.move_to_end(best_id)
        self.hits += 1
        self.hit_tokens += best_len
        return best, best_len

    def note_hit(self, tokens: int) -> None:
        """Count a prefix of `tokens` reused from elsewhere (a running row) in the stats."""
        self.hits += 1
        self.hit_tokens += tokens

    def insert(self, tokens: list[int], keys: list[mx.array], values: list[mx.array]) -> None:
        """Store KV for `tokens` (copies); drops entries it extends; evicts LRU to fit."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        arr = np.asarray(tokens, dtype=np.int32)
        for eid, entry in list(self._entries.items()):
            n = len(entry.tokens)
            if n >= len(arr) and np.array_equal(entry.tokens[: len(arr)], arr):
                self._entries.move_to_end(eid)  # already covered by a longer entry
                return
            if n < len(arr) and np.array_equal(arr[:n], entry.tokens):
                self._drop(eid)  # the new entry covers this one
        nbytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values, strict=True))
        nbytes = nbytes * self._counted // self._held  # exact: a stage's layers are alike
        if nbytes > self.max_bytes:
            return
        while self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        keys = [mx.array(k) for k in keys]
        values = [mx.array(v) for v in values]
        mx.eval(keys, values)  # own copies: the row may be overwritten right after
        self._entries[self._next_id] = PrefixEntry(arr, keys, values, nbytes)
        self._next_id += 1
        self.bytes += nbytes

    def clear(self) -> None:
        for eid in list(self._entries):
            self._drop(eid)

    def _drop(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        self.bytes -= entry.nbytes

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.hits, self.hit_tokens, self.lookups, len(self._entries), self.bytes, self.max_bytes
        )
