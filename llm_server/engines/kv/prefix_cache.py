"""Prompt prefix cache: KV of token prefixes the engine already computed, bounded in bytes.

Entries are token sequences with their keys/values for every layer ([heads, positions, dim]);
a prompt's embedding spans are held as their content keys (engines/plan.py: `prompt_key`,
negative int64 values that no token id equals), so a span matches only the same content.
A new prompt reuses the longest prefix it shares with any entry (in memory, else on the disk
tier, prefix_disk.py, when one is attached).

Eviction is size- and frequency-aware (GDSF-like, not LRU): an entry's priority is the cache's
clock plus (1 + hits, at most `MAX_FREQUENCY`) times the prefill work one reuse saves per byte
held, which grows with the reused length (attention's share of a prefill grows with it). The
lowest priority is evicted and the clock rises to it, so entries that are no longer hit age
out. A conversation's long shared prefix that is being hit thus outlives any number of short
unrelated prompts. An entry that extends another (a conversation's next turn), or that shares
all but a short tail of it, replaces it and inherits its hits: one copy per conversation. Two
entries sharing at least `TRUNK_TOKENS` (conversations on one system prompt and tool list) hold
the shared positions once, in a trunk entry both hang from; a trunk outlives its tails.

Models with recurrent layers (gated delta, mamba, convolutions: a state, not a KV, per layer)
hold state checkpoints with an entry (`marks`: position -> every recurrent layer's state after
that position, state.py `Checkpoint`), taken by rows.py while a prompt is prefilled and when a
row is released. A state cannot be cut back, so such a cache (`stateful`) reuses a prefix only
up to the latest checkpoint at or before the divergence; checkpoints count in an entry's bytes
and are evicted with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from llm_server.engines.kv.budget import Account
from llm_server.engines.kv.state import Checkpoint, checkpoint_bytes

MIN_BYTES = 64 << 20  # the default bound is at least this
AGENT_TOKENS = 2 * 20_480  # the default bound holds two 20k-token agent conversations...
MEMORY_FRACTION = 8  # ...but at most an eighth of the machine's memory
ATTENTION_TOKENS = (
    2048  # prefix length at which attention costs a prefill about what the products do
)
MAX_FREQUENCY = 8  # hits counted in a priority (more would pin an abandoned entry for ages)
SHORT_TAIL = 64  # a new entry sharing all but this many tokens of an old one replaces it
TRUNK_TOKENS = 256  # two entries sharing at least this many tokens hold them once (a trunk)


def kv_token_bytes(config: dict, width: int) -> int:
    """Bytes of keys and values one position takes in every layer (from a config.json)."""
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
    return int(config.get("num_hidden_layers") or 0) * 2 * kv_heads * head_dim * width


def default_bound(token_bytes: int, memory: int | None = None) -> int:
    """The default byte bound: `AGENT_TOKENS` positions, at most an eighth of `memory` (the
    machine's), at least `MIN_BYTES`. SmolLM2-135M in float32 (46,080 bytes a position):
    1.9 GB, 40,960 tokens."""
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(min(AGENT_TOKENS * token_bytes, memory // MEMORY_FRACTION), MIN_BYTES)


def reuse_value(reused: int, held: int) -> float:
    """Prefill work saved per byte held when `reused` of an entry's `held` tokens are reused."""
    return reused / max(held, 1) * (1 + reused / ATTENTION_TOKENS)


@dataclass(eq=False)
class PrefixEntry:
    """Token ids and their KV; with a `parent` (a trunk: a prefix two entries share), it
    holds only the positions after the parent's, and `keys`/`values` join the two."""

    tokens: np.ndarray  # [n] int64: token ids, and embedding spans' keys (step.prompt_key)
    own_keys: list[mx.array]  # per layer [kv_heads, n - start, dim]
    own_values: list[mx.array]
    nbytes: int  # of its own positions
    hits: int = 0
    value: float = 1.0  # reuse_value of its last hit (of a full reuse until hit)
    priority: float = 0.0
    parent: PrefixEntry | None = None
    children: int = 0  # entries whose parent it is (it is not evicted before them)
    # recurrent layers' state after some of its own positions (a stateful cache's)
    own_marks: dict[int, Checkpoint] = field(default_factory=dict)

    @property
    def marks(self) -> dict[int, Checkpoint]:
        """Checkpoints at its positions, its trunk's included."""
        if self.parent is None:
            return self.own_marks
        return {**self.parent.marks, **self.own_marks}

    @property
    def keys(self) -> list[mx.array]:
        return self._joined(self.own_keys, self.parent.keys if self.parent else None)

    @property
    def values(self) -> list[mx.array]:
        return self._joined(self.own_values, self.parent.values if self.parent else None)

    @staticmethod
    def _joined(own: list[mx.array], head: list[mx.array] | None) -> list[mx.array]:
        if head is None:
            return own
        return [mx.concatenate([h, o], axis=1) for h, o in zip(head, own, strict=True)]


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int
    hit_tokens: int
    lookups: int
    entries: int
    bytes: int
    max_bytes: int
    misses: int = 0
    disk_reads: int = 0  # entries loaded back from the disk tier
    disk_read_bytes: int = 0
    disk_writes: int = 0  # entries written to the disk tier
    disk_write_bytes: int = 0
    disk_bytes: int = 0  # bytes the disk tier holds now
    disk_entries: int = 0
    disk_corrupt: int = 0  # files skipped for a bad checksum, header or fingerprint
    # positions of released rows' histories still only in their rows (the engine's `kept`):
    # reused in place by their next turn, copied into the cache once about to be lost
    kept_tokens: int = 0


def usable(marks: dict[int, Checkpoint], length: int) -> int:
    """The latest checkpoint position at or before `length` (0: none)."""
    return max((p for p in marks if p <= length), default=0)


def _shared(a: np.ndarray, b: np.ndarray, n: int) -> int:
    """Length of the common prefix of a[:n] and b[:n]."""
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))


class PrefixCache:
    """Prompt prefixes by priority; `match` finds reusable KV, `insert` stores a row's history."""

    def __init__(
        self,
        max_bytes: int,
        min_tokens: int = 4,
        layers: tuple[int, int] = (1, 1),
        stateful: bool = False,
    ) -> None:
        """`layers`: (counted, held): bytes are counted as if the entries held `counted`
        layers where they hold `held` (a pipeline stage, whose eviction must match every
        other rank's); `stateful`: the model has recurrent layers, a prefix is reused only up
        to one of its entry's checkpoints."""
        if max_bytes < 0:
            raise ValueError("prefix cache bytes must be >= 0")
        self.max_bytes = max_bytes
        self._counted, self._held = layers
        self.min_tokens = min_tokens  # shorter matches are not worth a copy
        self.stateful = stateful
        self._entries: dict[int, PrefixEntry] = {}
        self._next_id = 0
        self._clock = 0.0
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0
        self.misses = 0
        self.disk = None  # a prefix_disk.DiskTier: evicted entries go there, hits come back
        # asked for an entry's bytes before it is copied in (engines/kv/budget.py: False
        # evicts entries by priority, then skips the entry); None: only `max_bytes` bounds it
        self.budget: Account | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    def attach_disk(self, disk) -> None:
        self.disk = disk

    def match(self, tokens: list[int], floor: int = 0) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `tokens` (all but the last token), and
        that length; (None, 0) unless it is longer than `floor` (what a running row holds) and
        at least `min_tokens`. Looks on the disk tier when memory holds less."""
        if not self.enabled:
            return None, 0
        query = np.asarray(tokens, dtype=np.int64)
        best, best_len = None, max(floor, self.min_tokens - 1)
        for entry in self._entries.values():
            n = min(len(entry.tokens), len(query) - 1)  # keep one token to compute logits from
            if n > best_len and (length := self.reusable(entry, query, n)) > best_len:
                best, best_len = entry, length
        if self.disk is not None:  # worth a read when it beats memory by an eighth
            loaded = self.disk.load_longest(
                query[:-1], best_len + best_len // 8 * (best is not None)
            )
            if loaded is not None:
                arr, keys, values, marks = loaded  # MLX arrays of their own (a lazy mx.array
                added = self._add(arr, keys, values, marks=marks)  # copy cost 177 MB more)
                if added is not None:
                    length = self.reusable(added, query, min(len(arr), len(query) - 1))
                    if length > best_len:
                        best, best_len = added, length
        if best is None:
            return None, 0
        best.hits += 1
        best.value = reuse_value(best_len, len(best.tokens))
        self._touch(best)
        return best, best_len

    def reusable(self, entry: PrefixEntry, query: np.ndarray, n: int) -> int:
        """Positions of `entry` a prompt `query` can reuse within its first `n`: the shared
        prefix, cut back to a checkpoint in a stateful cache."""
        length = _shared(entry.tokens, query, n)
        return usable(entry.marks, length) if self.stateful else length

    def add_read(
        self,
        tokens: np.ndarray,
        keys: list[mx.array],
        values: list[mx.array],
        marks: dict[int, Checkpoint] | None = None,
    ) -> bool:
        """An entry read back from the disk tier (`DiskTier.recent`), held in memory as if it
        had been hit; False when it does not fit the bound."""
        arr = np.asarray(tokens, dtype=np.int64)
        return self._add(arr, keys, values, marks=marks) is not None

    def record(self, reused: int) -> None:
        """Count one prefill in the stats: a hit of `reused` tokens (from an entry or a
        running row), or a miss."""
        if not self.enabled:
            return
        if reused:
            self.hits += 1
            self.hit_tokens += reused
        else:
            self.misses += 1

    def insert(
        self,
        tokens: list[int],
        keys: list[mx.array],
        values: list[mx.array],
        marks: dict[int, Checkpoint] | None = None,
    ) -> None:
        """Store KV for `tokens` (copies) and the state checkpoints `marks` (positions ->
        checkpoint; a stateful cache's); replaces the entries it extends or nearly covers;
        evicts by priority to fit."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        marks = {p: m for p, m in (marks or {}).items() if 0 < p <= len(arr)}
        hits, near, near_len = 0, None, 0
        for eid, entry in list(self._entries.items()):
            n = len(entry.tokens)
            shared = _shared(entry.tokens, arr, min(n, len(arr)))
            if shared == len(arr):
                self._touch(entry)  # already covered by a longer (or the same) entry
                self._add_marks(entry, marks)
                return
            nearly = n - shared <= SHORT_TAIL and shared >= max(n // 2, self.min_tokens)
            if nearly and not entry.children:
                hits = max(hits, entry.hits)  # the new entry covers this one (up to a tail)
                self._drop(eid, spill=shared < n)
            elif shared > near_len:
                near, near_len = entry, shared
        parent = self._trunk(near, near_len) if near_len >= TRUNK_TOKENS else None
        start = len(parent.tokens) if parent is not None else 0
        keys, values = [k[:, start:] for k in keys], [v[:, start:] for v in values]
        if self.budget is not None and not self._make_room(self._nbytes(keys, values), parent):
            return  # no room for the copy within the memory budget
        keys, values = [mx.array(k) for k in keys], [mx.array(v) for v in values]
        mx.eval(keys, values)  # own copies: the row may be overwritten right after
        if parent is not None:  # the trunk's positions' checkpoints are the trunk's
            self._add_marks(parent, {p: m for p, m in marks.items() if p <= start})
        own = {p: m for p, m in marks.items() if p > start}
        self._add(arr, keys, values, hits, parent, own)

    def _add_marks(self, entry: PrefixEntry, marks: dict[int, Checkpoint]) -> None:
        """Checkpoints `entry` (or its trunk, at the trunk's positions) does not hold yet."""
        if not self.stateful:
            return
        start = len(entry.parent.tokens) if entry.parent is not None else 0
        new = {p: m for p, m in marks.items() if start < p <= len(entry.tokens)}
        new = {p: m for p, m in new.items() if p not in entry.own_marks}
        if entry.parent is not None:
            self._add_marks(entry.parent, {p: m for p, m in marks.items() if p <= start})
        if not new:
            return
        nbytes = self._marks_bytes(new)
        if not self._make_room(nbytes, keep=entry):
            return
        entry.own_marks.update(new)
        entry.nbytes += nbytes
        self.bytes += nbytes

    def _trunk(self, entry: PrefixEntry, shared: int) -> PrefixEntry | None:
        """The entry a new one sharing `shared` tokens with `entry` hangs from: `entry`'s
        trunk, `entry` itself, or a trunk split off `entry` now (same bytes in all)."""
        if entry.parent is not None:
            return entry.parent if shared >= len(entry.parent.tokens) else None
        if shared == len(entry.tokens):
            return entry  # a trunk the new entry extends
        if entry.children:
            return None  # a trunk is not split again
        head_k = [mx.array(k[:, :shared]) for k in entry.own_keys]
        head_v = [mx.array(v[:, :shared]) for v in entry.own_values]
        entry.own_keys = [mx.array(k[:, shared:]) for k in entry.own_keys]
        entry.own_values = [mx.array(v[:, shared:]) for v in entry.own_values]
        mx.eval(head_k, head_v, entry.own_keys, entry.own_values)
        trunk = PrefixEntry(entry.tokens[:shared].copy(), head_k, head_v, 0, entry.hits)
        trunk.own_marks = {p: m for p, m in entry.own_marks.items() if p <= shared}
        entry.own_marks = {p: m for p, m in entry.own_marks.items() if p > shared}
        trunk.nbytes = self._nbytes(head_k, head_v, trunk.own_marks)
        own = self._nbytes(entry.own_keys, entry.own_values, entry.own_marks)
        self.bytes += trunk.nbytes + own - entry.nbytes
        entry.nbytes = own
        entry.parent, trunk.children, trunk.priority = trunk, 1, entry.priority
        self._entries[self._next_id] = trunk
        self._next_id += 1
        return trunk

    def _nbytes(
        self,
        keys: list[mx.array],
        values: list[mx.array],
        marks: dict[int, Checkpoint] | None = None,
    ) -> int:
        nbytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values, strict=True))
        nbytes = nbytes * self._counted // self._held  # exact: a stage's layers are alike
        return nbytes + self._marks_bytes(marks or {})

    def _marks_bytes(self, marks: dict[int, Checkpoint]) -> int:
        return sum(checkpoint_bytes(m) for m in marks.values()) * self._counted // self._held

    def _make_room(self, nbytes: int, keep: PrefixEntry | None = None) -> bool:
        """Evict by priority until `nbytes` more fit (never `keep` or a trunk with children);
        False when they cannot."""
        while self.bytes + nbytes > self.max_bytes or not self._granted(nbytes):
            leaves = [i for i, e in self._entries.items() if not e.children and e is not keep]
            if not leaves:
                return False
            victim = min(leaves, key=lambda i: (self._entries[i].priority, i))
            self._clock = max(self._clock, self._entries[victim].priority)
            self._drop(victim, spill=True)
        return True

    def shrink(self, nbytes: int) -> int:
        """Evict entries by priority (to the disk tier, if any) until `nbytes` are freed or
        none is left: the memory budget makes room for a KV growth. Returns bytes freed."""
        before = self.bytes
        while before - self.bytes < nbytes:
            leaves = [i for i, e in self._entries.items() if not e.children]
            if not leaves:
                break
            victim = min(leaves, key=lambda i: (self._entries[i].priority, i))
            self._clock = max(self._clock, self._entries[victim].priority)
            self._drop(victim, spill=True)
        return before - self.bytes

    def _granted(self, nbytes: int) -> bool:
        return self.budget is None or self.budget.reserve(nbytes, evict=False, own_cache=False)

    def _add(
        self,
        arr: np.ndarray,
        keys: list[mx.array],
        values: list[mx.array],
        hits: int = 0,
        parent: PrefixEntry | None = None,
        marks: dict[int, Checkpoint] | None = None,
    ) -> PrefixEntry | None:
        marks = dict(marks or {}) if self.stateful else {}
        nbytes = self._nbytes(keys, values, marks)
        if nbytes > self.max_bytes:
            return None
        if parent is not None:
            parent.children += 1  # not evicted to make room for its own child
        if not self._make_room(nbytes):  # only the new entry's own trunk is left
            if parent is not None:
                parent.children -= 1
            return None
        entry = PrefixEntry(arr, keys, values, nbytes, hits, parent=parent, own_marks=marks)
        self._touch(entry)
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.bytes += nbytes
        return entry

    def _touch(self, entry: PrefixEntry) -> None:
        entry.priority = self._clock + min(1 + entry.hits, MAX_FREQUENCY) * entry.value
        if entry.parent is not None:  # a trunk lives as long as its best child
            entry.parent.priority = max(entry.parent.priority, entry.priority)

    def persist(self) -> None:
        """Write every resident entry to the disk tier and wait for the writes (shutdown)."""
        if self.disk is None:
            return
        for entry in self._entries.values():
            if not entry.children:  # a trunk's positions are in its children's files
                self.disk.put(entry.tokens, entry.keys, entry.values, entry.marks)
        self.disk.close()

    def _drop(self, eid: int, spill: bool = False) -> None:
        entry = self._entries.pop(eid)
        self.bytes -= entry.nbytes
        if entry.parent is not None:
            entry.parent.children -= 1
        if spill and self.disk is not None:
            self.disk.put(entry.tokens, entry.keys, entry.values, entry.marks)

    def stats(self) -> PrefixCacheStats:
        disk = self.disk.stats() if self.disk is not None else {}
        return PrefixCacheStats(
            self.hits,
            self.hit_tokens,
            self.lookups,
            len(self._entries),
            self.bytes,
            self.max_bytes,
            self.misses,
            **disk,
        )
