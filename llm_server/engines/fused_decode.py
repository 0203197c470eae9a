"""The decode step (one new token per row) with stacked projections and fewer graph ops.

A decode step reads every weight once and, on a small model, also pays per graph op: mlx-lm's
layer runs seven products and ~40 small ops. Here each layer runs four products (q/k/v stacked
into one weight, gate/up into another), SiLU·up is one compiled kernel, and rotary embeddings
come from a cos/sin table built once (MLX's CPU rope recomputes them with scalar transcendentals
for every call). The model's own q/k/v and gate/up weights are rebound as row slices (views) of
the stacked ones, so the weights are held once and prefill/scoring keep running the mlx-lm
modules unchanged (`fused_layers`). Every output is the same dot product as in the separate
products, and the table holds exactly the values the rope module computes.

Under the linux_cpu kernel set (engines/kernels.py) `split=True` puts each product's output halves on two streams: with BLIS held to
one thread per stream (see `blas.threads`) that is faster than BLIS's own threading for the
skinny products of decoding.

`FusedForward.build(model, positions, kernels)` returns None for layers it does not know (quantized
weights, sliding windows, unknown attention extras); the engine then keeps the mlx-lm forward.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from llm_server.engines import cpu_kernels, decode_attention
from llm_server.engines.compiled_step import CompiledSteps, Rotation
from llm_server.engines.fused_layers import (
    Layer,
    Linear,
    bias_of,
    fusable,
    rope_table,
    rotate,
    rotate_eager,
    stack,
    table_matches,
)
from llm_server.engines.layout import PLAIN_HEAD_MODULES, model_family, output_head
from llm_server.engines.row_cache import RowView
from llm_server.native import decode_ops


class FusedForward:
    """Runs the model over the engine's row views with stacked products: decode steps
    (compiled when `enable_compiled` was called), mixed steps (`forward_groups`) and scoring."""

    def __init__(
        self, model, layers: list[Layer], lm_head: Linear, table: mx.array | None, kernels
    ):
        self.model = model
        self.kernels = kernels  # engines/kernels.py: the engine's KernelSet
        self.layers = layers
        self.lm_head = lm_head
        self.half = layers[0].head_dim // 2
        self.use_table(table)
        # compiled decode steps; None until `enable_compiled` (the engine's default on the
        # CPU, `MLXEngine(compiled_decode=...)`): every step builds its graph eagerly
        self.compiled: CompiledSteps | None = None

    def use_table(self, table: mx.array | None, ops: bool = True) -> None:
        """Rotate by `table` ([positions, Dh] cos | sin, shared by every layer; None: the
        layers' rope modules), and run every decode position's attention as the decode ops
        (llm_server.native.decode_ops) where they apply and `ops`: on the CPU, float32 layers
        rotated by a table, without q/k norms. Call before `enable_compiled`."""
        self.table = table
        self.rotation = Rotation.of(table)
        self.ops = None
        if (
            ops
            and table is not None
            and table.dtype == mx.float32
            and all(layer.q_norm is None and layer.k_norm is None for layer in self.layers)
            and all(layer.qkv.weight.dtype == mx.float32 for layer in self.layers)
        ):
            self.ops = decode_ops.module()
        # a compiled step runs each layer in four decode ops (decode_ops.whole_layer) where
        # they equal the separate ops bit for bit (checked at load) and no product has a bias
        self.whole_layers = (
            self.ops is not None
            and all(
                linear.bias is None
                for layer in self.layers
                for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            and decode_ops.layer_module() is not None
        )

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

    def logits(self, ids: mx.array, views: list[RowView], split: bool) -> mx.array:
        """ids [B, q] on the engine's rows -> logits [B, vocab] at each row's last position.

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
                ids, plan.rows, plan.starts, store.keys, store.values, split
            )
            return logits
        return self.forward(ids, views, plan.starts, plan.mask, split, last_only=True)

    def forward(
        self, ids: mx.array, caches: list, starts: list[int], mask, split: bool, last_only: bool
    ) -> mx.array:
        """ids [B, q] -> logits [B, vocab] (last position) or [B, q, vocab] (every position).

        `caches`: one per layer with `update_and_fetch(keys, values)` and `offset` (the engine's
        row views, or mlx-lm KV caches for a scoring session); `starts`: each row's first new
        position; `mask`: None, "causal" (lower-right aligned) or a bool array [B, 1, q, kv].
        """
        inner = self.model.model
        x = inner.embed_tokens(ids)  # [B, q, dim]
        b, q = ids.shape
        cos_sin = None
        if self.table is not None:
            pos = mx.array(starts)[:, None] + mx.arange(q)[None, :]  # [B, q]
            at = self.table[pos][:, None]  # [B, 1, q, Dh]
            cos_sin = (at[..., : self.half], at[..., self.half :])
        # prompts on the CPU: numpy's SIMD sigmoid for large inputs (cpu_kernels.swiglu)
        numpy_large = self.kernels.numpy_large
        silu_mul = cpu_kernels.swiglu if q > 1 and numpy_large else cpu_kernels.silu_mul
        exact = q == 1  # a decode step: the arithmetic every decode position shares
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer.norm_in(x)  # [B, q, dim]
            x = x + self._attention(layer, h, cache, mask, cos_sin, split, exact, starts)
            gu = layer.gate_up(layer.norm_post(x), split)
            act = silu_mul(gu[..., : layer.inter], gu[..., layer.inter :])
            x = x + layer.down(act, split)
        return self.lm_head(inner.norm(x[:, -1, :] if last_only else x), split)

    def forward_groups(
        self,
        groups: list[tuple[mx.array, list, list[int], object]],
        split: bool,
        every: frozenset[int] = frozenset(),
    ):
        """Several row groups in ONE forward -> logits [rows, vocab] at each row's last position
        (every position, row by row, of the groups whose index is in `every`: drafts being
        verified, scoring chunks).

        Each group is (ids [b, q], caches, starts, mask) as for `forward`: the decoding rows (q=1)
        and each prompt chunk (one row, q=chunk length) are separate groups. Their positions are
        packed into one sequence for the products (each weight is read once per step); attention
        runs per group, each against its own rows' keys, so every row sees only its own history
        and the result per row is the same as running it alone.

        Decode positions (the q=1 groups and the drafts in `every`) take the arithmetic of a
        pure decode step, compiled or not (decode_attention): the same attention, and MLX's
        SiLU where a prompt chunk's positions get numpy's. With the decode ops, prompt chunks
        attend through them too (`_attention`).
        """
        inner = self.model.model
        sizes = [ids.shape[0] * ids.shape[1] for ids, *_ in groups]
        x = mx.concatenate(
            [
                inner.embed_tokens(ids).reshape(1, n, -1)
                for (ids, *_), n in zip(groups, sizes, strict=True)
            ],
            axis=1,
        )  # [1, T, dim]
        tables = [self._cos_sin(starts, ids.shape[1]) for ids, _, starts, _ in groups]
        exact = [ids.shape[1] == 1 or g in every for g, (ids, *_) in enumerate(groups)]
        silu_mul = self._group_silu(sizes, exact, self.kernels.numpy_large)
        for i, layer in enumerate(self.layers):
            h = layer.norm_in(x)
            outs, off = [], 0
            for g, ((ids, caches, starts, mask), n) in enumerate(zip(groups, sizes, strict=True)):
                hg = h[:, off : off + n].reshape(ids.shape[0], ids.shape[1], -1)
                out = self._attention(
                    layer, hg, caches[i], mask, tables[g], split, exact[g], starts
                )
                outs.append(out.reshape(1, n, -1))
                off += n
            x = x + (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))
            gu = layer.gate_up(layer.norm_post(x), split)
            act = silu_mul(gu[..., : layer.inter], gu[..., layer.inter :])
            x = x + layer.down(act, split)
        last, off = [], 0
        for g, ((ids, *_), n) in enumerate(zip(groups, sizes, strict=True)):
            q = ids.shape[1]
            last += range(off, off + n) if g in every else range(off + q - 1, off + n, q)
            off += n
        return self.lm_head(inner.norm(x[0, mx.array(last)]), split)

    @staticmethod
    def _group_silu(sizes: list[int], exact: list[bool], numpy_large: bool):
        """silu(gate) * up over packed groups: MLX's kernel for the decode positions (`exact`
        groups, which come first in a step), and for the prompt chunks after them numpy's
        sigmoid (cpu_kernels.swiglu) under the linux_cpu set where MLX's kernels are not built
        for this CPU."""
        if sum(sizes) == 1 or not numpy_large or not cpu_kernels.numpy_silu():
            return cpu_kernels.silu_mul
        lead = 0  # packed positions of the leading exact groups
        for size, is_exact in zip(sizes, exact, strict=True):
            if not is_exact:
                break
            lead += size
        # all decode positions, or some after a chunk: MLX's for all
        if lead == sum(sizes) or lead < sum(n for n, e in zip(sizes, exact, strict=True) if e):
            return cpu_kernels.silu_mul
        if lead == 0:
            return cpu_kernels.swiglu

        def split_silu(gate: mx.array, up: mx.array) -> mx.array:
            head = cpu_kernels.silu_mul(gate[:, :lead], up[:, :lead])
            return mx.concatenate([head, cpu_kernels.swiglu(gate[:, lead:], up[:, lead:])], 1)

        return split_silu

    def _cos_sin(self, starts: list[int], q: int):
        """The rotary cos/sin of positions starts[b] + 0..q-1, [B, 1, q, Dh/2] each (None: the
        layers' rope modules rotate instead)."""
        if self.table is None:
            return None
        pos = mx.array(starts)[:, None] + mx.arange(q)[None, :]  # [B, q]
        at = self.table[pos][:, None]  # [B, 1, q, Dh]
        return at[..., : self.half], at[..., self.half :]

    def _attention(
        self, layer: Layer, h, cache, mask, cos_sin, split: bool, exact: bool, starts: list[int]
    ):
        """Every position on the engine's row store attends as a compiled decode step does,
        through the decode ops where they apply: prompt chunks too (one primitive per layer
        instead of a round trip through numpy: a 20-token prompt after a cached prefix ~100 ->
        74 ms, 1,000 tokens 6.0 -> 3.5 s, 3,000 tokens 29 -> 17 s on 2 cores). Without them,
        `exact` (decode positions) takes decode_attention's arithmetic under the linux_cpu set,
        and prompt chunks numpy's (linux_cpu) or MLX's attention."""
        hd, nh, nkv = layer.head_dim, layer.heads, layer.kv_heads
        b, q, _ = h.shape
        qkv = layer.qkv(h, split)  # [B, q, (H + 2 KV) * Dh]
        if self.ops is not None and isinstance(cache, RowView):  # as in a compiled step
            store, i, plan = cache.store, cache.layer, cache.plan
            if store.keys[i] is None:  # the first write since the store was made or cleared
                store.allocate(i, nkv, hd, hd, mx.float32)
            out, store.keys[i], store.values[i] = decode_attention.attend_ops(
                self.ops,
                layer,
                qkv.reshape(b * q, -1),
                store.keys[i],
                store.values[i],
                mx.array(plan.rows, dtype=mx.int32),
                mx.array(starts, dtype=mx.int32),
                self.rotation,
                q,
            )
            return layer.o(out.reshape(b, q, nh * hd), split)
        queries = qkv[..., : nh * hd].reshape(b, q, nh, hd)
        keys = qkv[..., nh * hd : (nh + nkv) * hd].reshape(b, q, nkv, hd)
        values = qkv[..., (nh + nkv) * hd :].reshape(b, q, nkv, hd)
        if layer.q_norm is not None:
            queries, keys = layer.q_norm(queries), layer.k_norm(keys)
        queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
        if cos_sin is None:
            queries = layer.rope(queries, offset=cache.offset)
            keys = layer.rope(keys, offset=cache.offset)
        elif q == 1:
            queries, keys = rotate(queries, *cos_sin), rotate(keys, *cos_sin)
        else:  # not compiled: one compile per prompt length would pile up
            queries, keys = rotate_eager(queries, *cos_sin), rotate_eager(keys, *cos_sin)
        keys, values = cache.update_and_fetch(keys, values)
        kernels, big = self.kernels, b * nh * q * keys.shape[2] >= cpu_kernels.NUMPY_MIN_ELEMENTS
        if exact and isinstance(cache, RowView) and kernels.decode_attention:
            width = decode_attention.span(cache.plan.kv_len, cache.store.capacity)
            keys, values = decode_attention.read(cache, width)
            at = decode_attention.mask(mx.array(starts, dtype=mx.int32), q, width)
            out = decode_attention.attend(queries, keys, values, at, layer.scale)
        elif q > 1 and kernels.numpy_large and big:
            out = cpu_kernels.attention(queries, keys, values, layer.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=layer.scale, mask=mask
            )
        return layer.o(out.transpose(0, 2, 1, 3).reshape(b, q, nh * hd), split)
