"""Per-row recurrent state for linear-attention and convolution layers (lfm2, qwen3_next,
nemotron_h, mamba-style mixers).

mlx-lm gives such a layer an `ArraysCache`: a few arrays [batch, ...] (a convolution tail, a
recurrent state) that the layer reads and replaces on every forward. Here each row keeps its own
slot; a forward sees one `RowStateView` per layer, which hands the layer the stacked state of the
rows it runs and stores what the layer writes back into each row's slot. The state after a
token depends only on the row's own history, so rows at different cursors batch exactly.

Unlike keys and values a state cannot be rewound: a row's slot holds the state after its last
finished forward, so the engine does not pipeline steps for models with such layers. Prompt
prefixes are reused through checkpoints instead (`take`/`put`: a copy of a row's slots after
a given position, kept with the KV of that prefix by rows.py and prefix_cache.py), and a
draft's rejected tail by putting back the `snapshot` from before the drafted step and running
the kept positions again (mlx/executor.py: `StepExecutor.rewind`).
"""

from __future__ import annotations

import mlx.core as mx

from llm_server.engines.kv.store import ForwardPlan

# one row's state after some position: per recurrent layer (StateStore order), its arrays
Checkpoint = tuple[tuple[mx.array | None, ...], ...]


def checkpoint_bytes(snap: Checkpoint) -> int:
    return sum(a.nbytes for arrays in snap for a in arrays if a is not None)


class StateStore:
    """The state slots of every row for every recurrent layer: `slots[layer][row]` is that
    row's list of arrays [1, ...] (None entries until the layer first writes them)."""

    def __init__(self, layers: list[int], rows: int, sizes: list[int]) -> None:
        self.rows = rows
        self.sizes = dict(zip(layers, sizes, strict=True))
        self.slots: dict[int, list[list[mx.array | None]]] = {
            layer: [[None] * size for _ in range(rows)] for layer, size in self.sizes.items()
        }

    def clear_row(self, row: int) -> None:
        for layer, size in self.sizes.items():
            self.slots[layer][row] = [None] * size

    @property
    def stateful(self) -> bool:
        return bool(self.sizes)

    def take(self, row: int) -> Checkpoint:
        """A copy of `row`'s slots now, every recurrent layer's (a checkpoint; evaluated)."""
        snap = tuple(
            tuple(None if a is None else mx.array(a) for a in self.slots[layer][row])
            for layer in self.sizes
        )
        mx.eval([a for arrays in snap for a in arrays if a is not None])
        return snap

    def put(self, row: int, snap: Checkpoint) -> None:
        """`row`'s slots as in `snap` (the arrays are shared: a forward replaces, never
        mutates, a slot's arrays)."""
        for layer, arrays in zip(self.sizes, snap, strict=True):
            self.slots[layer][row] = list(arrays)

    def snapshot(self, rows: list[int]) -> dict:
        """The rows' slots as they are now (restore() puts them back after a failed forward)."""
        return {(layer, r): list(self.slots[layer][r]) for layer in self.slots for r in rows}

    def restore(self, snap: dict) -> None:
        for (layer, r), arrays in snap.items():
            self.slots[layer][r] = arrays

    def arrays(self) -> list[mx.array]:
        return [
            a for per_row in self.slots.values() for row in per_row for a in row if a is not None
        ]


class RowStateView:
    """One recurrent layer's view of the rows of one forward: the `ArraysCache` interface."""

    def __init__(self, store: StateStore, layer: int, plan: ForwardPlan) -> None:
        self.store = store
        self.layer = layer
        self.plan = plan
        # every row's positions in a forward are real tokens (prefill runs one row, decode one
        # token per row): no padding to mask or to skip when the layer keeps its state
        self.lengths = None
        self.left_padding = None

    def __getitem__(self, idx: int) -> mx.array | None:
        slots = self.store.slots[self.layer]
        arrays = [slots[r][idx] for r in self.plan.rows]
        ref = next((a for a in arrays if a is not None), None)
        if ref is None:
            return None  # fresh rows: the layer starts from zeros
        if len(arrays) == 1:
            return ref
        return mx.concatenate([mx.zeros_like(ref) if a is None else a for a in arrays])

    def __setitem__(self, idx: int, value: mx.array) -> None:
        slots = self.store.slots[self.layer]
        if len(self.plan.rows) == 1:
            slots[self.plan.rows[0]][idx] = value
            return
        for b, r in enumerate(self.plan.rows):
            slots[r][idx] = value[b : b + 1]

    def advance(self, n: int) -> None:
        """Nothing to do: no padding is tracked (see lengths)."""

    def make_mask(self, n: int, **_) -> None:
        return None

    def empty(self) -> bool:
        return all(a is None for r in self.plan.rows for a in self.store.slots[self.layer][r])

    def is_trimmable(self) -> bool:
        return False
