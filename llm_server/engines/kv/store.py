"""A row-addressed KV cache that mlx-lm's model classes accept as their `cache` list.

The store keeps, per layer, keys and values for every row: [rows, kv_heads, capacity, head_dim]
(the layout attention reads without a copy), grown in steps of at least GROW positions and a
quarter of its capacity (no per-token concatenation); a row opened for a prompt grows it for the
whole prompt at once, with a quarter more room when the prompt is long (`reserve`). A forward
sees one `RowView` per layer, which tells the attention layer where each row's new keys go
(`offset`), writes them in place, and returns the keys each row may attend to plus a per-row
mask. Sliding-window layers keep every position too: their window is a per-row mask
(`make_mask(..., window_size=W)`), so rows at different cursors still batch exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from llm_server.engines.kv.budget import Account, BudgetRefused
from llm_server.engines.kv.format import KVFormat

GROW = 256  # positions added to every row's capacity at a time, at least...
HEADROOM = 4  # ...and at least a 1/HEADROOM of what it holds: each growth copies the store into
# fresh memory (177 MB at 3.7k positions of a SmolLM2 row), so a long conversation or answer
# growing 256 positions at a time paid that copy every 256 positions


class RowStore:
    """Keys/values of all rows for all layers; rows are independent, each with its own cursor.

    Rows are allocated when a forward first reaches one (`ensure_rows`) and dropped with
    everything else when the store is cleared. The first `first_rows` (the serving rows) come
    in powers of two, 1, 2, 4..., as requests take them (the lowest free row first): one
    conversation at a time holds one row's KV, not `--concurrent-requests` rows' (for SmolLM2
    in float32 at 4k positions, 188 MB instead of 754), and a long first prompt faults in only
    its own row's memory. Rows past `first_rows` (the engine's scoring rows) come all at once
    when scoring first runs: a server that never scores does not hold their KV (8 scoring rows
    of SmolLM2 are 94 MB at 256 positions, more than a serving row's 12)."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        max_positions: int,
        first_rows: int | None = None,
        kv_format: KVFormat | None = None,
    ) -> None:
        self.num_layers = num_layers
        # how values are held (None: as computed, float32 on the CPU)
        self.format = KVFormat("float32", "float32") if kv_format is None else kv_format
        self.dims: list[tuple[int, int] | None] = [None] * num_layers  # (k_dim, v_dim) a layer
        self.total_rows = rows
        self.first_rows = rows if first_rows is None else min(first_rows, rows)
        self.rows = min(self.first_rows, 1)  # rows allocated now (the store's first axis)
        self.max_positions = max_positions
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.capacity = 0
        # the memory budget (engines/kv/budget.py), asked for a growth's new arrays before
        # they are made, while the old ones are still held (None: no budget); and the bytes
        # a row's position takes over the layers, until the first write tells
        self.budget: Account | None = None
        self.position_bytes = 0

    def ensure(self, positions: int) -> None:
        """Grow every layer so each row can hold `positions` entries (lazy, step-wise)."""
        if positions <= self.capacity:
            return
        wanted = max(positions, self.capacity + self.capacity // HEADROOM)
        new_cap = min(self.max_positions, -(-wanted // GROW) * GROW)
        if new_cap == self.capacity:  # at max_positions already: a pad by 0 would copy it all
            return
        new_cap = self._granted(positions, new_cap)
        self._pad([(0, 0), (0, 0), (0, new_cap - self.capacity), (0, 0)])
        self.capacity = new_cap

    def reserve(self, positions: int) -> None:
        """`ensure` for a row opened with `positions`, plus a quarter for what follows (its
        answer, a conversation's next turn) once that is more than a few GROWs: a growth
        copies every row's KV into fresh memory (~1.9 s for 4 rows at 3.8k positions of
        SmolLM2 on a host faulting pages in at ~0.4 GB/s), while a small store grows cheaply.
        Nothing grows while the prompt and a GROW after it fit: a conversation's next turn,
        a few dozen positions longer, would otherwise grow the store again whenever its
        quarter no longer fit (SmolLM2's second chat turn over a 3.7k prompt: 0.36-0.87 s
        TTFT instead of 0.15-0.2)."""
        if positions + GROW <= self.capacity:
            return
        extra = positions // HEADROOM if positions > 4 * GROW else 0
        try:
            self.ensure(positions + extra)
        except BudgetRefused:  # the quarter more is a nicety the memory budget cannot give
            if not extra:
                raise
            self.ensure(positions)

    def ensure_rows(self, rows: int) -> None:
        """Make rows 0..rows-1 addressable: serving rows up to the next power of two (a copy of
        the rows held, as a capacity growth is), past `first_rows` every row at once."""
        if rows <= self.rows:
            return
        if rows > self.total_rows:
            raise ValueError(f"row {rows - 1} out of range 0..{self.total_rows - 1}")
        if rows > self.first_rows:
            new_rows = self.total_rows
        else:
            new_rows = min(self.first_rows, 1 << (rows - 1).bit_length())
        self._ask(new_rows, self.capacity)
        self._pad([(0, new_rows - self.rows), (0, 0), (0, 0), (0, 0)])
        self.rows = new_rows

    def _pad(self, pad: list[tuple[int, int]]) -> None:
        """Grow every allocated layer's keys and values by `pad` (zeros)."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:  # shapes are learnt at the first write
                self.keys[i] = mx.pad(self.keys[i], pad)
                self.values[i] = mx.pad(self.values[i], pad)

    def _granted(self, positions: int, capacity: int) -> int:
        """The capacity to grow to: `capacity`, else (refused) less headroom, halved down to
        exactly `positions`; BudgetRefused when even that does not fit."""
        positions = min(positions, capacity)  # (capacity is cut at max_positions)
        while capacity > positions:
            if self._ask(self.rows, capacity, refuse=False):
                return capacity
            capacity = positions + (capacity - positions) // 2
        self._ask(self.rows, positions)
        return positions

    def _ask(self, rows: int, capacity: int, refuse: bool = True) -> bool:
        """Whether the budget grants the store at `rows` x `capacity` (BudgetRefused if not,
        with `refuse`)."""
        per = sum(a.shape[1] * a.shape[3] * a.itemsize for a in self.arrays())
        nbytes = (per or self.position_bytes) * rows * capacity
        if self.budget is None or not nbytes or self.budget.reserve(nbytes):
            return True
        if refuse:
            raise self.budget.refused("the KV store's growth", nbytes)
        return False

    def arrays(self) -> list[mx.array]:
        """Every allocated key/value array (layers without KV, e.g. recurrent ones, have none)."""
        return [a for a in self.keys + self.values if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def clear(self) -> None:
        """Drop all storage (memory back to zero); cursors are the engine's business."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.capacity = 0
        self.rows = min(self.first_rows, 1)

    def write_prefix(self, row: int, keys: list[mx.array], values: list[mx.array], n: int) -> None:
        """Copy `n` cached positions ([heads, n, dim] per layer; None: a layer without KV)
        into the start of `row`."""
        self.ensure_rows(row + 1)
        self.ensure(n)
        for i in range(self.num_layers):
            if keys[i] is None:
                continue
            k, v = keys[i][:, :n], values[i][:, :n]  # as the store holds them
            if self.keys[i] is None:
                self._init_stored(i, k, v)
            self.keys[i][row, :, :n] = k
            self.values[i][row, :, :n] = v

    def read_row(self, row: int, n: int) -> tuple[list[mx.array], list[mx.array]]:
        """The first `n` positions of `row`, per layer [heads, n, dim] (lazy slices)."""
        return (
            [k[row, :, :n] for k in self.keys if k is not None],
            [v[row, :, :n] for v in self.values if v is not None],
        )

    def _init_layer(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """A layer's arrays shaped after its first (decoded) keys and values."""
        self.allocate(layer, keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)

    def _init_stored(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """A layer's arrays shaped after stored keys/values [heads, n, width] (a prefix)."""
        fmt = self.format
        k_dim, v_dim = self.dims[layer] or (
            fmt.dim_of(keys.shape[-1]),
            fmt.dim_of(values.shape[-1]),
        )
        self.allocate(layer, keys.shape[0], k_dim, v_dim, keys.dtype)

    def allocate(self, layer: int, heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """A layer's keys and values (zeros), before its first write: their shapes are
        otherwise learnt from the first keys written. `dtype`: the compute dtype's (a plain
        format of the compute dtype); other formats hold their own."""
        fmt = self.format
        held = dtype if fmt.identity else fmt.storage
        self.dims[layer] = (k_dim, v_dim)
        self.keys[layer] = mx.zeros((self.rows, heads, self.capacity, fmt.width(k_dim)), held)
        self.values[layer] = mx.zeros((self.rows, heads, self.capacity, fmt.width(v_dim)), held)

    def decode(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Stored keys/values of `layer` (any rows and positions) in the compute dtype."""
        if self.format.identity:
            return keys, values
        k_dim, v_dim = self.dims[layer]
        return self.format.decode(keys, k_dim), self.format.decode(values, v_dim)

    def encode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Computed keys/values [..., dim] as the store holds them."""
        if self.format.identity:
            return keys, values
        return self.format.encode(keys), self.format.encode(values)

    def bytes_per_token(self, heads: list[tuple[int, int, int]]) -> int:
        """KV bytes one position takes in every layer, `heads`: per layer with KV (kv heads,
        k_dim, v_dim)."""
        fmt = self.format
        return sum(h * (fmt.bytes_per_vector(k) + fmt.bytes_per_vector(v)) for h, k, v in heads)


@dataclass
class ForwardPlan:
    """Which rows a forward touches and where: worked out once, shared by every layer."""

    rows: list[int]  # store rows, one per batch entry
    starts: list[int]  # first position written per batch entry
    length: int  # new positions per batch entry (q)
    mask: mx.array | str | None  # [B, 1, q, kv_len] bool, "causal" or None (no window)
    kv_len: int  # positions each batch entry reads (max over entries of start + q)
    all_rows: bool  # rows == range(store.rows): read by slicing, not gathering
    # array masks get a query-group axis, [B, 1, 1, q, kv_len], for models whose attention
    # scores are [B, kv_heads, groups, q, kv_len] (mlx-lm's gemma2)
    group_axis: bool = False
    contiguous: bool = field(init=False)  # rows form one range: slice, never gather
    same_start: bool = field(init=False)  # every entry writes at the same position
    offset: int | mx.array = field(init=False)  # rope offset: shared int or per-entry [B]
    _masks: dict = field(init=False, default_factory=dict)  # (window, as_array) -> mask

    def __post_init__(self) -> None:
        self.contiguous = _is_range(self.rows)
        self.same_start = len(set(self.starts)) == 1
        self.offset = self.starts[0] if self.same_start else mx.array(self.starts)

    def mask_for(self, window: int | None, as_array: bool) -> mx.array | str | None:
        """The mask for keys within `window` positions of each query (None: no window);
        built once per forward and shared by the layers that ask for it."""
        if window is not None and max(self.starts) + self.length <= window:
            window = None  # no query of this forward reaches past its window
        if window is None and not as_array:
            return self.mask
        key = (window, as_array)
        if key not in self._masks:
            mask = row_mask(self.starts, self.length, self.kv_len, window, as_array)
            if self.group_axis and isinstance(mask, mx.array):
                mask = mask[:, :, None]
            self._masks[key] = mask
        return self._masks[key]


def row_mask(
    starts: list[int], q: int, kv_len: int, window: int | None = None, as_array: bool = False
) -> mx.array | str | None:
    """Mask [B, 1, q, kv_len]: entry b, query i sees key j iff j <= p and (no window or
    j > p - window), with p = starts[b] + i. As "causal"/None where that is the same thing."""
    if window is None and not as_array and len(set(starts)) == 1 and starts[0] + q == kv_len:
        return "causal" if q > 1 else None  # every entry reads exactly its own history
    pos = (mx.array(starts)[:, None] + mx.arange(q)[None, :])[:, :, None]  # [B, q, 1]
    keys = mx.arange(kv_len)[None, None, :]
    mask = keys <= pos
    if window is not None:
        mask = mask & (keys > pos - window)
    return mask[:, None, :, :]


class RowView:
    """One layer's view of the store for one forward; the interface mlx-lm attention calls."""

    def __init__(
        self, store: RowStore, layer: int, plan: ForwardPlan, window: int | None = None
    ) -> None:
        self.store = store
        self.layer = layer
        self.plan = plan
        self.offset = plan.offset
        self.window = window  # the layer's sliding window (mlx-lm gives it a RotatingKVCache)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """The mask mlx-lm's `create_attention_mask` asks the cache for (as RotatingKVCache
        does, a windowed layer's own window applies when the model names none)."""
        return self.plan.mask_for(window_size or self.window, return_array)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.store.keys[self.layer] is None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [B, kv_heads, q, dim] -> readable keys/values [B, kv_heads, kv_len, dim]."""
        store, plan, i = self.store, self.plan, self.layer
        if store.keys[i] is None:
            store._init_layer(i, keys, values)
        keys, values = store.encode(keys, values)
        q = plan.length
        if plan.same_start and plan.contiguous:
            r0, s = plan.rows[0], plan.starts[0]
            rows = slice(r0, r0 + len(plan.rows))
            store.keys[i][rows, :, s : s + q] = keys
            store.values[i][rows, :, s : s + q] = values
        else:
            # rows at their own cursors: one in-place slice update per row (cheaper than a
            # scatter, and the store keeps the layout attention reads directly)
            for b, (r, s) in enumerate(zip(plan.rows, plan.starts, strict=True)):
                store.keys[i][r : r + 1, :, s : s + q] = keys[b : b + 1]
                store.values[i][r : r + 1, :, s : s + q] = values[b : b + 1]
        kl = plan.kv_len
        if plan.all_rows:
            return store.decode(i, store.keys[i][:, :, :kl], store.values[i][:, :, :kl])
        if plan.contiguous:
            r0, r1 = plan.rows[0], plan.rows[0] + len(plan.rows)
            return store.decode(i, store.keys[i][r0:r1, :, :kl], store.values[i][r0:r1, :, :kl])
        ridx = mx.array(plan.rows)
        return store.decode(i, store.keys[i][ridx, :, :kl], store.values[i][ridx, :, :kl])


class RowCacheList:
    """Several caches of one layer (mlx-lm's CacheList), each a row view of its own slot."""

    def __init__(self, parts: list) -> None:
        self.caches = tuple(parts)

    def __getitem__(self, idx: int):
        return self.caches[idx]

    def is_trimmable(self) -> bool:
        return False


def _is_range(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))
