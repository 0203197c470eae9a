"""The one forward of the fused layers: a layer loop over packed positions (decode rows, prompt
chunks, drafts being verified, scoring chunks) whose arithmetic is the kernel set's.

A decode step reads every weight once and, on a small model, also pays per graph op: mlx-lm's
layer runs seven products and ~40 small ops. Here each layer runs four products (q/k/v stacked
into one weight, gate/up into another), and rotary embeddings may come from a cos/sin table
built once (the linux_cpu set: MLX's CPU rope recomputes them for every call). The model's own
q/k/v and gate/up weights are rebound as row slices (views) of the stacked ones, so the weights
are held once and the mlx-lm modules keep working (`fused_layers`).

`FusedForward.run` is the forward: `forward` (one group: a decode step, a scoring session's
chunk), `forward_groups` (a mixed step) and the compiled decode step (compiled_step: `run`
traced by `mx.compile`) all call it. Each per-layer operation is a function of the engine's
kernel set (engines/forward/kernels.py: the generic MLX set, or native/cpu_set.py's Linux-CPU set).

`FusedForward.build(model, positions, kernels)` returns None for layers it does not know (quantized
weights, sliding windows, unknown attention extras); the engine then keeps the mlx-lm forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from llm_server.engines.forward.compiled import CompiledSteps
from llm_server.engines.forward.layers import (
    Group,
    Layer,
    Linear,
    Rotation,
    bias_of,
    fusable,
    rope_table,
    rotate,
    rotate_eager,
    stack,
    table_matches,
)
from llm_server.engines.kv.store import RowView
from llm_server.engines.mlx.layout import PLAIN_HEAD_MODULES, model_family, output_head


class GroupViews(NamedTuple):
    """One group of `forward_groups`, on the rows' views of the store: `group` turns it into
    the packed forward's `Group` (layers.py) with the attention the kernel set builds."""

    ids: mx.array  # [rows, q] token ids
    caches: list  # per layer: the rows' views (store.RowView) or mlx-lm caches
    starts: list[int]  # each row's cursor
    mask: object  # None, "causal" or a bool array [B, 1, q, kv] (store.row_mask), as `forward`


class FusedForward:
    """Runs the model over the engine's row views with stacked products: decode steps
    (compiled when `enable_compiled` was called), mixed steps (`forward_groups`) and scoring,
    all through `run`."""

    def __init__(
        self, model, layers: list[Layer], lm_head: Linear, table: mx.array | None, kernels
    ):
        self.model = model
        self.kernels = kernels  # engines/forward/kernels.py: the engine's KernelSet
        self.layers = layers
        self.lm_head = lm_head
        self.use_table(table)
        # compiled decode steps; None until `enable_compiled` (the engine's default on the
        # CPU, `EngineSettings(compiled_decode=...)`): every step builds its graph eagerly
        self.compiled: CompiledSteps | None = None

    def use_table(self, table: mx.array | None, native: bool = True) -> None:
        """Rotate by `table` ([positions, Dh] cos | sin, shared by every layer; None: the
        layers' rope modules), with the kernel set's kernels for these layers (`k`: the
        contexts of this forward's steps; `native`: the set's native attention where it has
        one, e.g. the Linux-CPU set's decode ops). Call before `enable_compiled`."""
        self.table = table
        self.rotation = Rotation.of(table)
        self.k = self.kernels.functions.fused(self.layers, table, self.rotation, native)

    def enable_compiled(self) -> None:
        """Run decode steps (q = 1) as compiled graphs from now on (see compiled_step)."""
        self.compiled = CompiledSteps(self)

    @classmethod
    def build(cls, model, positions: int, kernels) -> FusedForward | None:
        if model_family(model) not in PLAIN_HEAD_MODULES:
            return None  # e.g. granite: llama's layer names, but multipliers this does not apply
        inner = getattr(model, "model", None)
        blocks = getattr(inner, "layers", None)
        if not blocks or not all(fusable(b) for b in blocks):
            return None
        if not isinstance(getattr(inner, "norm", None), nn.RMSNorm):
            return None
        head, tied = output_head(model)
        if type(head) not in (nn.Embedding, nn.Linear):
            return None  # a quantized head
        lm_head = Linear(head.weight, None if tied else bias_of(head))
        attn0 = blocks[0].self_attn
        head_dim = attn0.q_proj.weight.shape[0] // attn0.n_heads
        table = None
        if kernels.rope_table:  # Metal's rope kernel is fast; the CPU's recomputes cos/sin
            table = rope_table(attn0.rope, head_dim, positions, attn0.q_proj.weight.dtype)
            if table is not None and not all(
                table_matches(table, b.self_attn.rope) for b in blocks
            ):
                table = None  # layers with different rotary settings
        layers = []
        for block in blocks:
            attn, mlp = block.self_attn, block.mlp
            layers.append(
                Layer(
                    qkv=stack([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o=Linear(attn.o_proj.weight, bias_of(attn.o_proj)),
                    gate_up=stack([mlp.gate_proj, mlp.up_proj]),
                    down=Linear(mlp.down_proj.weight, bias_of(mlp.down_proj)),
                    norm_in=block.input_layernorm,
                    norm_post=block.post_attention_layernorm,
                    rope=attn.rope,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    heads=attn.n_heads,
                    kv_heads=attn.n_kv_heads,
                    head_dim=head_dim,
                    scale=attn.scale,
                    inter=mlp.gate_proj.weight.shape[0],
                )
            )
        return cls(model, layers, lm_head, table, kernels)

    def logits(self, ids: mx.array, views: list[RowView], context) -> mx.array:
        """ids [B, q] on the engine's rows -> logits [B, vocab] at each row's last position
        (`context`: the kernel set's context of the step, `k.context`).

        A decode step (q = 1) on a store that holds every layer runs the compiled graph of its
        shape (see compiled_step); the store's arrays are then replaced by the step's outputs.
        """
        plan = views[0].plan
        store = views[0].store
        if (
            self.compiled is not None
            and plan.length == 1
            and all(k is not None for k in store.keys)
        ):
            logits, store.keys, store.values = self.compiled.run(
                ids, plan.rows, plan.starts, store.keys, store.values, context, store.format
            )
            return logits
        return self.forward(ids, views, plan.starts, plan.mask, context, last_only=True)

    def forward(
        self, ids: mx.array, caches: list, starts: list[int], mask, context, last_only: bool
    ) -> mx.array:
        """ids [B, q] -> logits [B, vocab] (last position) or [B, q, vocab] (every position):
        `run` with one group.

        `caches`: one per layer with `update_and_fetch(keys, values)` and `offset` (the engine's
        row views, or mlx-lm KV caches for a scoring session); `starts`: each row's first new
        position; `mask`: None, "causal" (lower-right aligned) or a bool array [B, 1, q, kv].
        """
        b, q = ids.shape
        group = self.group(ids, caches, starts, mask, context, exact=q == 1, every=not last_only)
        logits = self.run([group], context)
        return logits if last_only else logits.reshape(b, q, -1)

    def forward_groups(
        self,
        groups: list[GroupViews],
        context,
        every: frozenset[int] = frozenset(),
        inputs: Mapping[int, tuple[tuple[int, mx.array], ...]] | None = None,
    ):
        """Several row groups in ONE forward -> logits [rows, vocab] at each row's last position
        (every position, row by row, of the groups whose index is in `every`: drafts being
        verified, scoring chunks): `run` over the groups.

        Each group is its ids [b, q] on its rows' views as for `forward`: the decoding rows (q=1)
        and each prompt chunk (one row, q=chunk length) are separate groups. Decode positions
        (the q=1 groups and the drafts in `every`) take the arithmetic of a pure decode step.
        `inputs`: group index -> its input embeddings (`Group.inputs`).
        """
        built = [
            self.group(
                ids, caches, starts, mask, context, ids.shape[1] == 1 or g in every, g in every
            )
            for g, (ids, caches, starts, mask) in enumerate(groups)
        ]
        for g, rows in (inputs or {}).items():
            built[g].inputs = rows
        return self.run(built, context)

    def group(
        self,
        ids: mx.array,
        caches: list,
        starts: list[int],
        mask,
        context,
        exact: bool,
        every: bool,
    ) -> Group:
        """A group of `run` on `caches`, attending as the kernel set's context builds it (on
        the engine's rows, `rows`, the set's native attention where it has one; else MLX ops,
        ViewAttention)."""
        rows = caches[0].plan.rows if isinstance(caches[0], RowView) else None
        attention = context.attention(caches, starts, mask, ids.shape[1], exact, rows)
        return Group(ids, attention, exact, every)

    def run(self, groups: list[Group], context) -> mx.array:
        """THE forward: the groups' positions packed into one sequence [T, dim] through every
        layer -> logits [selected positions, vocab] (each row's last position; every position
        of an `every` group), in group order. A pure decode step is this function compiled
        (compiled_step).

        Norms, the stacked gate/up and down products run once over all positions (each weight
        read once per step); each group's q/k/v product, attention and o product run on its own
        positions, against its own rows, so every row sees only its own history and its result
        is the one it gets alone. The arithmetic is the kernel set's (`context`, from `self.k`).
        """
        k, inner = context, self.model.model
        sizes = [g.size for g in groups]
        embedded = [with_inputs(inner.embed_tokens(g.ids.reshape(-1)), g.inputs) for g in groups]
        x = embedded[0] if len(groups) == 1 else mx.concatenate(embedded)  # [T, dim]
        decode = all(g.q == 1 for g in groups)  # a decode-only step
        silu_mul = k.activation(sizes, [g.exact for g in groups])
        whole = None  # a decode step's layer as one call of the set (None: op by op)
        if len(groups) == 1 and decode:
            whole = groups[0].attention.whole_layer
        for i, layer in enumerate(self.layers):
            if whole is not None:  # the decode ops' four ops, the same values
                x = whole(layer, i, x)
                continue
            h = k.norm(layer.norm_in, x)
            if len(groups) == 1:
                out = groups[0].attention(layer, i, k.product(layer.qkv, h))
                x = k.add_product(x, layer.o, out, decode)
            else:
                outs, off = [], 0
                for g, n in zip(groups, sizes, strict=True):
                    out = g.attention(layer, i, k.product(layer.qkv, h[off : off + n]))
                    outs.append(k.product(layer.o, out))
                    off += n
                x = x + mx.concatenate(outs)
            gate, up = k.pair(layer.gate_up, k.norm(layer.norm_post, x))
            x = k.add_product(x, layer.down, silu_mul(gate, up), decode)
        return k.head(self.lm_head, k.norm(inner.norm, _selected(x, groups)))


def with_inputs(x: mx.array, inputs) -> mx.array:
    """Token embeddings x [n, dim] with input embeddings in their place: `inputs` is
    (offset, rows [m, dim]) in order (`Group.inputs`; mlx-lm's forward, mlx_forward.py)."""
    if not inputs:
        return x
    parts, at = [], 0
    for offset, rows in inputs:
        parts += [x[at:offset], rows.astype(x.dtype)]
        at = offset + rows.shape[0]
    return mx.concatenate([*parts, x[at:]])


def _selected(x: mx.array, groups: list[Group]) -> mx.array:
    """The packed positions [T, dim] whose logits leave the forward: each row's last position,
    every position of an `every` group."""
    if all(g.every or g.q == 1 for g in groups):
        return x
    if len(groups) == 1:
        g = groups[0]
        return x.reshape(g.rows, g.q, -1)[:, -1]
    last, off = [], 0
    for g in groups:
        last += range(off, off + g.size) if g.every else range(off + g.q - 1, off + g.size, g.q)
        off += g.size
    return x[mx.array(last)]


class ViewAttention:
    """A group's attention as MLX ops over its caches (RowViews or mlx-lm KV caches): q/k
    norms, the rotation (a cos/sin table, else the layer's rope module), the cache's write and
    read, and the kernel set's attention arithmetic (the context's `attend`)."""

    whole_layer = None  # (only the decode ops run a whole layer)

    def __init__(self, context, caches: list, starts: list[int], mask, cos2_sin2, exact: bool):
        self.k, self.caches, self.starts, self.mask = context, caches, starts, mask
        self.cos2_sin2, self.exact = cos2_sin2, exact  # [B, 1, q, Dh] each (None: rope)

    def __call__(self, layer: Layer, i: int, qkv: mx.array) -> mx.array:
        """qkv [b * q, (H + 2 KV) * Dh] (row by row) -> [b * q, H * Dh]."""
        hd, nh, nkv = layer.head_dim, layer.heads, layer.kv_heads
        b, cache = len(self.starts), self.caches[i]
        qkv = qkv.reshape(b, -1, qkv.shape[-1])
        q = qkv.shape[1]
        queries = qkv[..., : nh * hd].reshape(b, q, nh, hd)
        keys = qkv[..., nh * hd : (nh + nkv) * hd].reshape(b, q, nkv, hd)
        values = qkv[..., (nh + nkv) * hd :].reshape(b, q, nkv, hd)
        if layer.q_norm is not None:
            queries, keys = layer.q_norm(queries), layer.k_norm(keys)
        queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
        if self.cos2_sin2 is None:
            queries = layer.rope(queries, offset=cache.offset)
            keys = layer.rope(keys, offset=cache.offset)
        elif q == 1:
            queries, keys = rotate(queries, *self.cos2_sin2), rotate(keys, *self.cos2_sin2)
        else:  # not compiled: one compile per prompt length would pile up
            queries = rotate_eager(queries, *self.cos2_sin2)
            keys = rotate_eager(keys, *self.cos2_sin2)
        keys, values = cache.update_and_fetch(keys, values)
        view = cache if isinstance(cache, RowView) else None
        out = self.k.attend(layer, queries, keys, values, self.mask, view, self.starts, self.exact)
        return out.transpose(0, 2, 1, 3).reshape(b * q, nh * hd)
