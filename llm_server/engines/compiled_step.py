"""The fused decode step (one new token per row) as a compiled MLX graph, built once per shape.

An eager decode step rebuilds its graph in Python every token (~2,800 ops on SmolLM2, ~4 ms
of Python on 2 CPU cores). Here the step is traced once per (rows, KV capacity) with
`mx.compile` and replayed from C++ after that; elementwise chains also fuse into single
kernels. Everything that changes from step to step is an input array: the token ids, each
row's position, the store rows, and the KV store itself (returned updated, so the compiled
function stays pure). Attention reads a fixed span of each row's store (the longest history
rounded up to `decode_attention.SPAN` positions) with a per-row mask, so a graph serves SPAN
tokens of the longest row; the store's capacity (grown in `row_cache.GROW` steps) is part of
the shape too.

Under the linux_cpu kernel set (engines/kernels.py) the graph's logits equal the eager forward's bit for bit (decode_attention says
why): the eager decode positions, of a pure decode step or of a mixed one, run the same
products, the same rotation and the same `decode_attention.attend` over the same span, and
compiling changes no rounding. So a row's greedy tokens do not depend on whether a step was
compiled, mixed or batched (S10).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from llm_server.engines import cpu_kernels, decode_attention
from llm_server.native import decode_ops

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
    split: bool  # products split across two CPU streams (this thread's: see CompiledSteps)


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
        split: bool,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """One token per row: ids [B, 1] -> (logits [B, vocab], updated keys, updated values).

        `keys`/`values`: the store's arrays per layer, [store_rows, KV, capacity, Dh].
        """
        store_rows, _, capacity, _ = keys[0].shape
        if self.decoder.ops is not None:  # the decode ops read each row's positions 0..p
            span, first_row = 0, 0  # themselves: one graph for any history and any rows
        else:
            span = decode_attention.span(max(starts) + 1, capacity)
            first_row = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else -1
        shape = StepShape(len(rows), capacity, span, store_rows, first_row, split)
        fn = self._graph(shape)
        pos = mx.array(starts, dtype=mx.int32)
        row_ids = mx.array(rows, dtype=mx.int32)
        out = fn(ids, pos, row_ids, *keys, *values)
        n = len(keys)
        return out[0], list(out[1 : 1 + n]), list(out[1 + n :])

    def _graph(self, shape: StepShape) -> Callable:
        graphs = getattr(self._local, "graphs", None)
        if graphs is None:
            graphs = self._local.graphs = OrderedDict()
        fn = graphs.get(shape)
        if fn is not None:
            graphs.move_to_end(shape)
            return fn
        fn = graphs[shape] = mx.compile(self._step_fn(shape))
        with self._lock:
            self.traces += 1
        while len(graphs) > MAX_GRAPHS:
            graphs.popitem(last=False)
        return fn

    def _step_fn(self, shape: StepShape) -> Callable:
        decoder, rotation = self.decoder, self.rotation
        layers = len(decoder.layers)

        def step(ids, pos, row_ids, *kv):
            keys, values = list(kv[:layers]), list(kv[layers:])
            if decoder.ops is not None:
                attention = _OpsAttention(decoder.ops, rotation, pos, row_ids)
            else:
                attention = _GraphAttention(
                    decode_attention.mask(pos, 1, shape.span),  # [B, 1, 1, span]
                    rotation,
                    pos,
                    _writer(shape, pos, row_ids),
                    _reader(shape, row_ids),
                    decoder.kernels.decode_attention,
                )
            logits, new_keys, new_values = _body(decoder, attention, ids, keys, values, shape.split)
            return (logits, *new_keys, *new_values)

        return step


@dataclass(frozen=True)
class Rotation:
    """Rotary embedding as x * cos2 + roll(x) * sin2: one roll (a split and a concatenation)
    and one fused kernel per layer for queries and keys together (the half-split form takes
    two slices, two kernels and a concatenation for each). roll(x) = [x2 | x1] copies values,
    so this is the half-split form's arithmetic: x1 * cos + x2 * -sin, x2 * cos + x1 * sin."""

    cos2: mx.array  # [positions, Dh] = [cos | cos]
    sin2: mx.array  # [positions, Dh] = [-sin | sin]

    @classmethod
    def of(cls, table: mx.array | None) -> Rotation | None:
        if table is None:
            return None
        half = table.shape[-1] // 2
        cos, sin = table[:, :half], table[:, half:]
        out = cls(mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1))
        mx.eval(out.cos2, out.sin2)
        return out

    @staticmethod
    def swap(x: mx.array) -> mx.array:
        """x [..., Dh] -> [x2 | x1], its halves exchanged."""
        return mx.roll(x, x.shape[-1] // 2, axis=-1)


@mx.compile
def _rotate(x: mx.array, swapped: mx.array, cos2: mx.array, sin2: mx.array) -> mx.array:
    return x * cos2 + swapped * sin2


def _attention(layer, queries, keys, values, mask, cpu_arithmetic: bool) -> mx.array:
    """queries [B, H, 1, Dh] over keys/values [B, KV, span, Dh] -> [B, H * Dh]: under the
    linux_cpu kernel set the arithmetic every decode position shares (decode_attention), under
    the generic set MLX's fused kernel."""
    b, nh, _, hd = queries.shape
    if cpu_arithmetic:
        nkv = keys.shape[1]
        grouped = queries.reshape(b, nkv, nh // nkv, hd)
        out = decode_attention.attend_grouped(grouped, keys, values, mask, layer.scale)
    else:
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )
    return out.reshape(b, nh * hd)


class _OpsAttention:
    """A layer's decode attention as the decode ops: three ops (llm_server.native.decode_ops);
    or, where the decoder has `whole_layers`, the whole layer as four of them (`layer`)."""

    def __init__(self, ops, rotation: Rotation, pos: mx.array, row_ids: mx.array) -> None:
        self.ops, self.rotation, self.pos, self.row_ids = ops, rotation, pos, row_ids

    def __call__(self, layer, qkv: mx.array, keys: mx.array, values: mx.array):
        return decode_attention.attend_ops(
            self.ops, layer, qkv, keys, values, self.row_ids, self.pos, self.rotation, 1
        )

    def layer(self, layer, x: mx.array, keys: mx.array, values: mx.array):
        """x [B, dim] through `layer` -> (x', keys', values'): `_body`'s eleven ops of a layer
        as four, the same values (decode_ops.whole_layer)."""
        rot = self.rotation
        return decode_ops.whole_layer(
            self.ops, layer, x, keys, values, self.row_ids, self.pos, rot.cos2, rot.sin2
        )


class _GraphAttention:
    """A layer's decode attention as MLX ops: `write(store, new)` puts a layer's new entries
    into its store array, `read(store)` returns the step's rows of it [B, KV, span, Dh]; mask
    [B, 1, 1, span] bool."""

    def __init__(
        self, mask, rotation: Rotation | None, pos: mx.array, write, read, cpu_arithmetic: bool
    ) -> None:
        self.mask, self.rotation, self.pos, self.write, self.read = mask, rotation, pos, write, read
        self.cpu_arithmetic = cpu_arithmetic  # KernelSet.decode_attention
        if rotation is not None:  # [B, 1, 1, Dh], gathered once per step
            self.cos2 = rotation.cos2[pos][:, None, None]
            self.sin2 = rotation.sin2[pos][:, None, None]

    def __call__(self, layer, qkv: mx.array, keys: mx.array, values: mx.array):
        b = qkv.shape[0]
        hd, nh, nkv = layer.head_dim, layer.heads, layer.kv_heads
        qk = qkv[:, : (nh + nkv) * hd].reshape(b, nh + nkv, 1, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(b, nkv, 1, hd)
        if layer.q_norm is not None:
            qk = mx.concatenate([layer.q_norm(qk[:, :nh]), layer.k_norm(qk[:, nh:])], axis=1)
        if self.rotation is None:
            qk = layer.rope(qk, offset=self.pos)
        else:
            qk = _rotate(qk, self.rotation.swap(qk), self.cos2, self.sin2)
        keys, values = self.write(keys, qk[:, nh:]), self.write(values, v)
        out = _attention(
            layer, qk[:, :nh], self.read(keys), self.read(values), self.mask, self.cpu_arithmetic
        )
        return out, keys, values


def _body(decoder, attention, ids, keys, values, split: bool):
    """One token per row through every layer: ids [B, 1]; `attention(layer, qkv, keys,
    values)` -> (out [B, H * Dh], the layer's updated keys and values). Returns (logits [B,
    vocab] float32, the updated keys and values per layer).

    The hidden state stays 2-D, [B, features] (one position per row): a product is then one
    plain matmul, without the broadcast/flatten views a [B, 1, features] input adds; heads are
    [B, heads, 1, Dh], the store's layout, so no op only adds an axis. Every op of the graph
    costs a dispatch (~1.5-3 us on the CPU) whatever its size, so views are taken once: one
    slice per store read, the residual added by the product itself (`fused_layers.Linear.add_to`).
    """
    inner = decoder.model.model
    b = ids.shape[0]
    x = inner.embed_tokens(ids.reshape(b))  # [B, dim]

    def norm(module, x):  # with the decode ops one op, MLX's values bit for bit (checked)
        ops = decoder.ops
        return module(x) if ops is None else ops.rms_norm(x, module.weight, module.eps)

    addmm = decoder.kernels.addmm
    new_keys, new_values = [], []
    for i, layer in enumerate(decoder.layers):
        if decoder.whole_layers and not split:  # (only with the decode ops: _OpsAttention)
            x, k, v = attention.layer(layer, x, keys[i], values[i])  # the same, in four ops
            new_keys.append(k)
            new_values.append(v)
            continue
        qkv = layer.qkv(norm(layer.norm_in, x), split)  # [B, (H + 2 KV) * Dh]
        out, k, v = attention(layer, qkv, keys[i], values[i])
        new_keys.append(k)
        new_values.append(v)
        x = layer.o.add_to(x, out, split, addmm)
        gate, up = layer.gate_up.pair(norm(layer.norm_post, x), split)
        x = layer.down.add_to(x, cpu_kernels.silu_mul(gate, up), split, addmm)
    logits = decoder.lm_head(norm(inner.norm, x), split).astype(mx.float32)
    return logits, new_keys, new_values


def _writer(shape: StepShape, pos: mx.array, row_ids: mx.array) -> Callable:
    """store [R, KV, cap, Dh], new [B, KV, 1, Dh] -> store with each row's new entry written."""

    start = mx.stack([row_ids[0], pos[0]]) if shape.batch == 1 else None  # once, not per layer

    def write(store: mx.array, new: mx.array) -> mx.array:
        if start is None:  # one scatter for every row (in place, as the slice update)
            store[row_ids, :, pos] = new[:, :, 0]
            return store
        return mx.slice_update(store, new, start, axes=(0, 2))

    return write


def _reader(shape: StepShape, row_ids: mx.array) -> Callable:
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
