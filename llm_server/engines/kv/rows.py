"""The MLX engine's rows: who holds which tokens, where each row's cursor is, and their KV.

Serving rows come first in one `RowStore`, the scoring rows after them; recurrent layers keep
a per-row slot in a `StateStore`. A row's cursor is the length of its token list. A fresh
prompt copies in the longest prefix held elsewhere (the prefix cache, a running row or a
released row's kept history). A model served serially keeps
mlx-lm's own caches of its one row instead of views of the store.

A released row also keeps its history where it is (`kept`): its KV stays in the store until the
row is opened again or the store is given back, so the next turn of a conversation opened on
that row (`preferred_row` picks it) reuses its prefix in place, with no copy. When no row is
busy the store is given back after `keep_alive` seconds (`trim_idle`; 0: at once), not at
once: a fresh store's first long write faults in its pages (~0.5 s for 4k positions of SmolLM2
at 4 rows), which a conversation's next turn would otherwise pay every time.

A kept history goes to the prefix cache only when its KV is about to be lost (`unsaved`): the
row opened for a prompt that does not carry it on, the store given back, the engine stopping.
A conversation whose every turn comes back to its row never copies its KV (the copy was ~0.05 s
a turn at 4k positions of SmolLM2, and ~0.5 s the first time, its pages faulted in), and
meanwhile other rows' prompts reuse it from the row (`_live_prefix`).

Recurrent layers (a model with a `StateStore` state) cannot be cut back to a shorter prefix,
so each row also keeps state checkpoints (`marks`: position -> state.py `Checkpoint`): after
each prefill chunk that reaches a multiple of `CHECKPOINT_SPACING` (the recompute any other
divergence costs at most), at the end of the prompt and, at release, at the end of the answer
(where a conversation's next turn diverges). A prefix is then reused (from the row itself,
another row or the prefix cache, which stores them with the KV) only up to the latest
checkpoint at or before the divergence: the KV is cut there and the state restored. A row
keeps at most `MAX_CHECKPOINTS`, thinned evenly (the latest always kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from llm_server.engines.kv.prefix_cache import SHORT_TAIL, PrefixCache, usable
from llm_server.engines.kv.state import Checkpoint, StateStore
from llm_server.engines.kv.store import RowStore

CHECKPOINT_SPACING = 512  # a prefill chunk reaching a multiple of this keeps the state there
MAX_CHECKPOINTS = 16  # a row's history keeps at most this many (thinned evenly)


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
        keep_alive: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`store`/`states` hold `rows` serving rows then `score_rows` scoring rows;
        `serial_cache`: makes mlx-lm's caches of the one row (a model served serially);
        `keep_alive`: seconds an idle store is kept (with the released rows' histories)."""
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
        # a free serving row's last history, whose KV the store still holds at positions
        # 0..len-1 (reused in place by the next prompt opened on the row that shares it)
        self.kept: list[list[int]] = [[] for _ in range(total)]
        self.unsaved = [False] * total  # a kept history the prefix cache does not hold yet
        # each row's state checkpoints (its tokens', then its kept history's): position ->
        # every recurrent layer's state after it (empty without recurrent layers)
        self.marks: list[dict[int, Checkpoint]] = [{} for _ in range(total)]
        self.released = [0] * total  # release order of the rows (the oldest kept is given up)
        self._releases = 0
        self.keep_alive = keep_alive
        self.idle_since: float | None = None  # when the last busy row was released
        self._clock = clock

    def cursor(self, row: int) -> int:
        return len(self.tokens[row])

    def check_row(self, row: int, scoring: bool = False) -> None:
        """A serving row (`scoring`: or one of the scoring rows after them)."""
        last = self.rows + (self.score_rows if scoring else 0) - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} out of range 0..{last}")

    def check_idle(self, row: int) -> None:
        """A serving row with no decode step in flight (a prompt may be opened or run on it)."""
        self.check_row(row)
        if self.ahead[row]:
            raise RuntimeError(f"row {row} has a decode step in flight; release it first")

    def advance(self, row: int, ids: Sequence[int]) -> None:
        """`row` holds the KV of `ids` after its cursor now (the forward just run wrote it)."""
        self.tokens[row].extend(ids)

    def forget(self, row: int) -> None:
        """`row` holds nothing (a prompt opened for a step that failed, a scoring chunk's row
        reset): its next positions are written from 0."""
        self.tokens[row] = []

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of the row's last prefill that came from the prefix cache."""
        return self.cached[row]

    def decode_starts(self, rows: list[int]) -> list[int]:
        """Where each row's next decode position is: its cursor plus the steps in flight."""
        return [self.cursor(r) + self.ahead[r] for r in rows]

    def start_decode(self, rows: list[int]) -> list[int]:
        """A decode step is in flight on `rows`; their epochs (`finish_decode` checks them)."""
        for r in rows:
            self.ahead[r] += 1
        return [self.epoch[r] for r in rows]

    def finish_decode(self, rows: list[int], epochs: list[int], tokens: list[int] | None) -> None:
        """The step on `rows` is done: each row still of its epoch (not released since) takes
        its token (None: the step was dropped and the rows stay where they were)."""
        for i, (r, epoch) in enumerate(zip(rows, epochs, strict=True)):
            if self.epoch[r] != epoch:
                continue  # released (and maybe reused) while the step was in flight
            self.ahead[r] -= 1
            if tokens is not None:
                self.tokens[r].append(tokens[i])

    def open(self, row: int, tokens: list[int]) -> int:
        """Reset `row` for a new prompt (its kept history saved to the prefix cache first when
        the prompt drops it) and reuse the longest prefix held: the row's own, else copied in
        from the prefix cache or another row; returns the positions reused (the cursor)."""
        self.states.clear_row(row)
        self.idle_since = None
        self.store.reserve(len(tokens))  # the whole prompt now, not chunk by chunk
        if self._make_serial is not None:
            self.serial_cache = self._make_serial()
        kept = self._kept_prefix(row, tokens)
        if len(self.kept[row]) - kept > SHORT_TAIL:  # more is lost than the prompt carries on
            self._save(row)
        self.kept[row], self.unsaved[row] = [], False
        own, self.marks[row] = self.marks[row], {}
        source, shared = self._live_prefix(row, tokens)
        entry, reused = self.prefix_cache.match(tokens, floor=max(shared, kept))
        if entry is not None:  # the cache holds more of this prompt than any row
            self._write(row, entry.keys, entry.values, reused)
            marks = entry.marks
        elif shared > kept:  # a running row holds more of it than this row kept
            keys, values = self.store.read_row(source, shared)
            self._write(row, keys, values, shared)
            reused, marks = shared, self.marks[source]
        else:  # the row's own KV, where its last request left it: nothing to copy
            reused, marks = kept, own
        if self.states.stateful and reused:  # resume from the checkpoint there
            self.states.put(row, marks[reused])
            self.marks[row] = {p: m for p, m in marks.items() if p <= reused}
        self.prefix_cache.record(reused)
        self.tokens[row] = tokens[:reused]
        self.cached[row] = reused
        return reused

    def _write(self, row: int, keys: list[mx.array], values: list[mx.array], n: int) -> None:
        """Copy `n` positions of KV (one array per layer with KV, as `read_row` gives and the
        prefix cache holds) into the start of `row`; layers with a state take none."""
        if self.states.stateful:
            kv = iter(range(len(keys)))
            at = [
                None if i in self.states.sizes else next(kv) for i in range(self.store.num_layers)
            ]
            keys = [None if j is None else keys[j] for j in at]
            values = [None if j is None else values[j] for j in at]
        self.store.write_prefix(row, keys, values, n)

    def mark(self, row: int, start: int, total: int) -> None:
        """After a prefill chunk from `start` (the row's cursor now its end) of a prompt of
        `total` positions: keep the row's state there when the chunk reached a multiple of
        `CHECKPOINT_SPACING` or the prompt's end (a model with recurrent layers)."""
        end = self.cursor(row)
        if end == total or end // CHECKPOINT_SPACING > start // CHECKPOINT_SPACING:
            self._checkpoint(row)

    def _checkpoint(self, row: int) -> None:
        """The row's state at its cursor, among its checkpoints (thinned to MAX_CHECKPOINTS:
        the one whose neighbours are closest goes, never the latest)."""
        if (
            not (self.states.stateful and self.prefix_cache.enabled)
            or self.serial_cache is not None
        ):
            return
        marks = self.marks[row]
        marks[self.cursor(row)] = self.states.take(row)
        while len(marks) > MAX_CHECKPOINTS:
            at = sorted(marks)
            gaps = [at[i + 1] - (at[i - 1] if i else 0) for i in range(len(at) - 1)]
            del marks[at[gaps.index(min(gaps))]]

    def _live_prefix(self, row: int, tokens: list[int]) -> tuple[int, int]:
        """The other row holding the longest prefix of `tokens` (all but the last) and its
        length: the choices of an `n` > 1 request, prompts sharing a system prompt sent
        together, or a kept history not yet saved to the prefix cache. (0, 0) when none shares
        at least the prefix cache's minimum."""
        best_row, best = 0, 0
        if not self.prefix_cache.enabled:
            return best_row, best
        query = np.asarray(tokens[:-1], dtype=np.int64)
        for r, busy in enumerate(self.tokens[: self.rows]):
            held = busy or (self.kept[r] if self.unsaved[r] else [])
            n = min(len(held), query.size)
            if r == row or n <= max(best, self.prefix_cache.min_tokens - 1):
                continue
            differ = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != query[:n])
            length = int(differ[0]) if differ.size else n
            if self.states.stateful:  # a state resumes only from a checkpoint
                length = usable(self.marks[r], length)
            if length > best and length >= self.prefix_cache.min_tokens:
                best_row, best = r, length
        return best_row, best

    def _kept_prefix(self, row: int, tokens: list[int]) -> int:
        """Positions of `row`'s kept history that `tokens` starts with (all but its last
        token; 0 below the prefix cache's minimum or with the cache off)."""
        held = self.kept[row]
        n = min(len(held), len(tokens) - 1)
        if not self.prefix_cache.enabled or n < self.prefix_cache.min_tokens:
            return 0
        differ = np.flatnonzero(
            np.asarray(held[:n], dtype=np.int64) != np.asarray(tokens[:n], dtype=np.int64)
        )
        shared = int(differ[0]) if differ.size else n
        if self.states.stateful:  # a state resumes only from a checkpoint
            shared = usable(self.marks[row], shared)
        return shared if shared >= self.prefix_cache.min_tokens else 0

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int:
        """The free row of `rows` to open `tokens` on: the one whose kept history shares the
        longest prefix with it, else one keeping nothing (one the store holds already first:
        a row past them grows the store), else the one released longest ago (so a
        conversation's rows survive other requests in between)."""
        best, best_len = None, 0
        for r in rows:
            if (n := self._kept_prefix(r, tokens)) > best_len:
                best, best_len = r, n
        if best is not None:
            return best
        held = self.store.rows
        return min(rows, key=lambda r: (bool(self.kept[r]), r >= held, self.released[r], r))

    def release(self, row: int) -> None:
        """Free `row`; a serving row's history (prompt + generated) stays in the row (`kept`),
        for the prefix cache once it is about to be lost (a scoring row's never: scoring needs
        the logits of every position anyway). With no row busy, the store is given back now
        or, with a history kept, after `keep_alive` seconds (`trim_idle`)."""
        self.check_row(row, scoring=True)
        held = self.tokens[row]
        if held and self.prefix_cache.enabled and row < self.rows:
            self._checkpoint(row)  # the end of the answer: where the next turn diverges
            self.kept[row], self.unsaved[row] = held, True
            self._releases += 1
            self.released[row] = self._releases
        else:
            self.marks[row] = {}
        self.tokens[row] = []
        self.ahead[row] = 0
        self.epoch[row] += 1
        self.states.clear_row(row)
        self.serial_cache = None
        if not any(self.tokens):
            if self.keep_alive > 0 and any(self.kept):
                self.idle_since = self._clock()
            else:
                self.clear()

    def resume(self) -> int:
        """After a restart: the disk tier's most recently used entries, one per serving row,
        read back into the prefix cache and into the rows as their kept histories (the most
        recent one released last), so each conversation's next turn reuses its prefix in place
        rather than reading its file then; given back after the keep-alive like any idle
        store. Returns the rows resumed (0: no disk tier, or no keep-alive)."""
        disk = self.prefix_cache.disk
        if disk is None or self.keep_alive <= 0 or any(self.tokens):
            return 0
        loaded = disk.recent(self.rows)
        for row, (tokens, keys, values, marks) in enumerate(loaded):
            self.prefix_cache.add_read(tokens, keys, values, marks)
            self.store.reserve(len(tokens))  # room for the conversation's next turn
            self._write(row, keys, values, len(tokens))
            self.marks[row] = dict(marks) if self.states.stateful else {}
        for row in reversed(range(len(loaded))):
            self.kept[row] = loaded[row][0].tolist()
            self._releases += 1
            self.released[row] = self._releases
        if loaded:
            mx.eval(self.store.arrays())  # the pages faulted in now, during the load
            self.idle_since = self._clock()
        return len(loaded)

    def clear(self) -> None:
        """Give the KV memory back (no row busy): the store, and the histories it held (to
        the prefix cache first)."""
        self.save_kept()
        self.store.clear()
        mx.clear_cache()
        self.kept = [[] for _ in self.kept]
        self.marks = [{} for _ in self.marks]  # (no row busy: only kept histories' marks)
        self.idle_since = None

    def save_kept(self) -> None:
        """Every kept history the prefix cache does not hold yet, into it (the store is going
        back, or the engine stops and the cache goes to its disk tier)."""
        for row in range(self.rows):
            self._save(row)

    def unsaved_tokens(self) -> int:
        return sum(len(k) for k, u in zip(self.kept, self.unsaved, strict=True) if u)

    def _save(self, row: int) -> None:
        if self.unsaved[row] and self.kept[row]:
            keys, values = self.store.read_row(row, len(self.kept[row]))
            self.prefix_cache.insert(self.kept[row], keys, values, self.marks[row])
        self.unsaved[row] = False

    def idle_due(self) -> float | None:
        """Seconds until an idle store is due back (<= 0: now); None when nothing idle is held."""
        if self.idle_since is None:
            return None
        return self.keep_alive - (self._clock() - self.idle_since)

    def trim_idle(self, force: bool = False) -> bool:
        """Give an idle store back once its keep-alive is over (`force`: now, a request waits
        for room in the memory budget); True when it did."""
        due = self.idle_due()
        if due is None or (due > 0 and not force) or any(self.tokens):
            return False
        self.clear()
        return True

    def rewind(self, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on: its token list, hence what the prefix
        cache gets, holds only what was kept; the KV there is overwritten by the next forward."""
        self.check_row(row)
        if not 0 <= cursor <= self.cursor(row):
            raise ValueError(f"row {row} holds {self.cursor(row)} positions, not {cursor}")
        del self.tokens[row][cursor:]
        for p in [p for p in self.marks[row] if p > cursor]:
            del self.marks[row][p]

    def held(self) -> list[mx.array]:
        """Every array the rows keep between forwards (evaluated with each step)."""
        if self.serial_cache is not None:
            from mlx.utils import tree_flatten

            leaves = tree_flatten([c.state for c in self.serial_cache])
            return [a for _, a in leaves if isinstance(a, mx.array)]
        return self.store.arrays() + self.states.arrays()
