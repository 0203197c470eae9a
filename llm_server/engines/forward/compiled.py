"""The fused decode step (one new token per row) as a compiled MLX graph, built once per shape.

An eager decode step rebuilds its graph in Python every token (~2,800 ops on SmolLM2, ~4 ms
of Python on 2 CPU cores). Here the step is traced once per (rows, KV capacity) with
`mx.compile` and replayed from C++ after that; elementwise chains also fuse into single
kernels. Everything that changes from step to step is an input array: the token ids, each
row's position, the store rows, and the KV store itself (returned updated, so the compiled
function stays pure). Attention reads a fixed span of each row's store (the longest history
rounded up to `mlx_ops.SPAN` positions) with a per-row mask, so a graph serves SPAN
tokens of the longest row; the store's capacity (grown in `row_cache.GROW` steps) is part of
the shape too.

The graph is the forward itself: `FusedForward.run` over one group of decode rows, traced,
with the group's attention reading and writing the store arrays that are the graph's inputs
(built by the step's kernel context: the native decode ops, or `GraphAttention`'s MLX ops).
Under the linux_cpu kernel set (engines/forward/kernels.py) its logits equal the eager forward's bit for bit (native/decode_attention
says why): the eager decode positions, of a pure decode step or of a mixed one, run the same
products, the same rotation and the same attention arithmetic over the same span, and
compiling changes no rounding. So a row's greedy tokens do not depend on whether a step was
compiled, mixed or batched (S10).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import mlx.core as mx

from llm_server.engines.forward.layers import Group, Rotation, rotate
from llm_server.engines.kv.format import KVFormat

MAX_GRAPHS = 48  # compiled graphs kept (each is a small tape of ops; weights are shared)


@dataclass(frozen=True)
class StepShape:
    """What a compiled step is specialised to."""

    batch: int  # rows in the step (B)
    capacity: int  # KV positions per store row (the store's current capacity)
    span: int  # positions attention reads per row (<= capacity)
    store_rows: int  # rows of the store
    first_row: int  # the step's rows are range(first_row, first_row + batch): a slice, no
    # gather (-1: scattered rows, gathered). With the scoring rows after the serving rows the
    # store never holds the step's rows alone, and a gather copied every layer's K and V
    context: Hashable  # the kernel set's forward context (`key`: e.g. products split across
    # two CPU streams, this thread's: see CompiledSteps)
    # how the store holds keys and values (written encoded, read decoded)
    kv: KVFormat = KVFormat("float32", "float32")


class CompiledSteps:
    """Compiled decode steps of one `FusedForward`, keyed by `StepShape` (least recently used
    dropped past MAX_GRAPHS), each thread its own.

    A compiled function is called from one thread only. MLX caches a traced graph per thread,
    keyed by the Python function's address, and a dropped compiled function erases its entry
    from the cache of the thread that called it last only (mlx 0.32.4, ml-explore/mlx#3940).
    A graph called from two threads (a step on the constructing thread, then the scheduler's)
    would leave an entry behind when its engine is dropped: a later function at the same
    address with the same input shapes replays the dead graph and its weights, a wrong answer.
    The split streams are per thread too, so a new driving thread retraces either way.
    """

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.rotation = decoder.rotation
        self._local = threading.local()  # .graphs: OrderedDict[StepShape, Callable]
        self._lock = threading.Lock()
        self.traces = 0  # graphs built, all threads (tests and benchmarks read it)

    def run(
        self,
        ids: mx.array,
        rows: list[int],
        starts: list[int],
        keys: list[mx.array],
        values: list[mx.array],
        context,
        kv: KVFormat,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """One token per row: ids [B, 1] -> (logits [B, vocab], updated keys, updated values).

        `keys`/`values`: the store's arrays per layer, [store_rows, KV, capacity, width] in the
        store's format `kv`; `context`: the kernel set's context of the step
        (engines/forward/kernels.py: ForwardContext).
        """
        store_rows, _, capacity, _ = keys[0].shape
        span = self.decoder.k.graph_span(max(starts) + 1, capacity)
        if span == 0:  # the set's attention reads each row's positions 0..p itself: one
            first_row = 0  # graph for any history and any rows
        else:
            first_row = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else -1
        shape = StepShape(len(rows), capacity, span, store_rows, first_row, context.key, kv)
        fn = self._graph(shape, context)
        pos = mx.array(starts, dtype=mx.int32)
        row_ids = mx.array(rows, dtype=mx.int32)
        out = fn(ids, pos, row_ids, *keys, *values)
        n = len(keys)
        return out[0], list(out[1 : 1 + n]), list(out[1 + n :])

    def _graph(self, shape: StepShape, context) -> Callable:
        graphs = getattr(self._local, "graphs", None)
        if graphs is None:
            graphs = self._local.graphs = OrderedDict()
        fn = graphs.get(shape)
        if fn is not None:
            graphs.move_to_end(shape)
            return fn
        fn = graphs[shape] = mx.compile(self._step_fn(shape, context))
        with self._lock:
            self.traces += 1
        while len(graphs) > MAX_GRAPHS:
            graphs.popitem(last=False)
        return fn

    def _step_fn(self, shape: StepShape, context) -> Callable:
        """The step of `shape` with `context`'s kernels (every context of the same key has
        the same arithmetic: the graph serves them all)."""
        decoder = self.decoder
        layers = len(decoder.layers)

        def step(ids, pos, row_ids, *kv):
            keys, values = list(kv[:layers]), list(kv[layers:])  # replaced layer by layer
            attention = context.graph_attention(keys, values, pos, row_ids, shape)
            group = Group(ids, attention, exact=True, every=True)
            logits = decoder.run([group], context).astype(mx.float32)
            return (logits, *keys, *values)

        return step


class GraphAttention:
    """A compiled decode step's attention as MLX ops over the store's arrays (the graph's
    inputs, replaced in `keys`/`values` by the written ones): `write(store, new)` puts a
    layer's new entries into its store array, `read(store)` returns the step's rows of it
    [B, KV, span, Dh]; mask [B, 1, 1, span] bool; the forward context's `attend_graph`."""

    whole_layer = None  # (only the decode ops run a whole layer)

    def __init__(
        self,
        context,
        keys: list,
        values: list,
        mask,
        rotation: Rotation | None,
        pos,
        write,
        read,
        kv: KVFormat,
    ) -> None:
        self.k, self.keys, self.values, self.mask = context, keys, values, mask
        self.rotation, self.pos, self.write, self.read = rotation, pos, write, read
        self.kv = kv  # the store's format: new entries encoded, the read span decoded
        if rotation is not None:  # [B, 1, 1, Dh], gathered once per step
            self.cos2 = rotation.cos2[pos][:, None, None]
            self.sin2 = rotation.sin2[pos][:, None, None]

    def __call__(self, layer, i: int, qkv: mx.array) -> mx.array:
        """qkv [B, (H + 2 KV) * Dh] -> [B, H * Dh]."""
        b = qkv.shape[0]
        hd, nh, nkv = layer.head_dim, layer.heads, layer.kv_heads
        qk = qkv[:, : (nh + nkv) * hd].reshape(b, nh + nkv, 1, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(b, nkv, 1, hd)
        if layer.q_norm is not None:
            qk = mx.concatenate([layer.q_norm(qk[:, :nh]), layer.k_norm(qk[:, nh:])], axis=1)
        if self.rotation is None:
            qk = layer.rope(qk, offset=self.pos)
        else:
            qk = rotate(qk, self.cos2, self.sin2)
        k, kv = qk[:, nh:], self.kv
        if not kv.identity:
            k, v = kv.encode(k), kv.encode(v)
        self.keys[i] = self.write(self.keys[i], k)
        self.values[i] = self.write(self.values[i], v)
        keys, values = self.read(self.keys[i]), self.read(self.values[i])
        if not kv.identity:
            keys, values = kv.decode(keys, hd), kv.decode(values, hd)
        return self.k.attend_graph(layer, qk[:, :nh], keys, values, self.mask)


def writer(shape: StepShape, pos: mx.array, row_ids: mx.array) -> Callable:
    """store [R, KV, cap, Dh], new [B, KV, 1, Dh] -> store with each row's new entry written."""

    start = mx.stack([row_ids[0], pos[0]]) if shape.batch == 1 else None  # once, not per layer

    def write(store: mx.array, new: mx.array) -> mx.array:
        if start is None:  # one scatter for every row (in place, as the slice update)
            store[row_ids, :, pos] = new[:, :, 0]
            return store
        return mx.slice_update(store, new, start, axes=(0, 2))

    return write


def reader(shape: StepShape, row_ids: mx.array) -> Callable:
    """store [R, KV, cap, Dh] -> the step's rows [B, KV, span, Dh]."""

    whole = shape.first_row == 0 and shape.batch == shape.store_rows

    def read(store: mx.array) -> mx.array:
        if whole and shape.span == shape.capacity:
            return store
        if shape.first_row >= 0:  # one slice of rows and span together (one op, not two)
            return store[shape.first_row : shape.first_row + shape.batch, :, : shape.span]
        rows = mx.take(store, row_ids, axis=0)
        return rows if shape.span == shape.capacity else rows[:, :, : shape.span]

    return read
