"""The Linux-CPU kernel set: the arithmetic of a fused layer as the CPU runs it fastest with
one rounding per position, whatever step it rides in (see engines/forward/kernels.py for the interface
and the generic MLX set beside it).

- norms: the decode ops' RMSNorm (one op, `mx.fast.rms_norm`'s values bit for bit) where the
  model's layers take the decode ops;
- products: 1-2 row products split over two CPU streams when the engine says so (`split`: BLIS
  runs such skinny products on one core), a decode step's residual added inside its product;
- SiLU: MLX's fused kernel for decode positions, numpy's sigmoid for prompt chunks where MLX's
  kernels are not built for this CPU (cpu_kernels.swiglu);
- attention: decode positions with decode_attention's arithmetic over a fixed span, large
  prompt chunks through numpy's softmax (cpu_kernels.attention), the rest MLX's own; every
  position through the native decode ops where they apply (FusedForward builds those groups).

Layers are duck-typed (engines/forward/layers.py: `Layer`, `Linear` with `.wt`, `.halves`,
`.bias`): the native folder never imports the engines.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import mlx.core as mx

from llm_server.native import (
    blas,
    cpu_kernels,
    decode_attention,
    decode_ops,
    mlx_lm_patches,
    skinny,
)

SPLIT_MAX_POSITIONS = 256  # forwards up to this many positions split their products (splits)


class LinuxCPUKernels:
    """The linux_cpu set's functions (one instance per engine: its only state is the count of
    split decode steps in flight, `hold_split`)."""

    name = "linux_cpu"

    def __init__(self) -> None:
        self._held = 0  # split decode steps in flight (BLIS held to one thread meanwhile)

    # -- what the set offers a model (chosen once, when the forward is built) --

    @staticmethod
    def decode_ops(layers: list, table: mx.array | None):
        """The native decode ops where every position of these layers may attend through them
        (float32 layers rotated by a table, without q/k norms), else None."""
        if (
            table is None
            or table.dtype != mx.float32
            or any(layer.q_norm is not None or layer.k_norm is not None for layer in layers)
            or any(layer.qkv.weight.dtype != mx.float32 for layer in layers)
        ):
            return None
        return decode_ops.module()

    @staticmethod
    def whole_layers(layers: list, ops) -> bool:
        """Whether a decode step may run each layer as the decode ops' four (decode_ops.
        whole_layer): where they equal the separate ops bit for bit (checked at load) and no
        product has a bias."""
        return (
            ops is not None
            and all(
                linear.bias is None
                for layer in layers
                for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            and decode_ops.layer_module() is not None
        )

    @staticmethod
    def whole_layer(attention, split: bool):
        """A one-group decode step's layer as the decode ops' four (`attention.whole_layer`),
        unless the step splits its products: the four ops run their own, unsplit."""
        return None if split else attention.whole_layer

    @staticmethod
    def splits(positions: int) -> bool:
        """Whether a float32 fused forward over `positions` (rows x new tokens) splits its
        products in halves over two CPU streams, each on one BLIS thread: BLIS runs a 1-2 row
        product on one core whatever its thread count, and forks both cores for every product
        of a short prompt (tiny attention products too); from a few hundred positions its own
        threading wins again. Never while the skinny library is loaded (it threads the
        products itself)."""
        if skinny.loaded():
            return False
        if positions <= cpu_kernels.SPLIT_MAX_ROWS:
            return True
        return blas.threads_settable() and positions <= SPLIT_MAX_POSITIONS

    @staticmethod
    def split_threads(split: bool):
        """A context for one forward: one BLIS thread per split half while it runs."""
        return blas.threads(1) if split else nullcontext()

    def hold_split(self, split: bool) -> None:
        """A split decode step starts: BLIS on one thread until `release_split` (a pipelined
        step is finished later, and the next may start before)."""
        if split:
            self._held += 1
            blas.set_threads(1)

    def release_split(self, split: bool) -> None:
        """A step `hold_split` saw is finished or dropped: BLIS's own threads once none is left."""
        if split:
            self._held -= 1
            if self._held == 0:
                blas.set_threads(blas.default_threads())

    # -- mlx-lm's forward, for families outside the fused layers --

    @staticmethod
    def patch_mlx_lm(model) -> None:
        """Route the model family's attention and SwiGLU through numpy for large tensors
        (mlx_lm_patches.install)."""
        mlx_lm_patches.install(model, True)

    @staticmethod
    def split_mlx_lm(model) -> None:
        """Swap the decoder layers' float nn.Linear modules for ones whose 1-2 row products
        are split over two streams (a model the fused layers do not run)."""
        mlx_lm_patches.split_linears(model)

    @staticmethod
    def mlx_lm_head(layer, tied: bool, hidden: mx.array) -> mx.array:
        """The model's output projection `layer` (`tied`: the embedding's `as_linear`) over
        hidden [..., dim], split over two streams for a 1-2 row decode step."""
        return mlx_lm_patches.lm_head(layer, tied, hidden, True)

    # -- the layer's arithmetic --

    @staticmethod
    def norm(module, x: mx.array, ops) -> mx.array:
        """RMSNorm: with the decode ops one op, MLX's values bit for bit (checked at load)."""
        return module(x) if ops is None else ops.rms_norm(x, module.weight, module.eps)

    @staticmethod
    def product(linear, x: mx.array, split: bool) -> mx.array:
        """x [T, in] @ linear [out, in].T (+ bias); `split`: the output halves on two streams."""
        out = cpu_kernels.split_matmul_halves(x, linear.halves) if split else x @ linear.wt
        return out if linear.bias is None else out + linear.bias

    @classmethod
    def add_product(cls, x: mx.array, linear, a: mx.array, split: bool, decode: bool) -> mx.array:
        """x + a @ linear: in a decode-only step one addmm (the product writes onto a copy of x,
        each output s + x as in the separate add: alpha = beta = 1), one op fewer."""
        if split or linear.bias is not None or not decode:
            return x + cls.product(linear, a, split)
        return mx.addmm(x, a, linear.wt)

    @classmethod
    def pair(cls, linear, x: mx.array, split: bool) -> tuple[mx.array, mx.array]:
        """The two halves of a stacked gate/up product, each on its own stream when `split`:
        no concatenation and no slicing of a joint output."""
        if linear.bias is not None or not split:
            gate, up = mx.split(cls.product(linear, x, split), 2, axis=-1)
            return gate, up
        return cpu_kernels.split_matmuls(x, linear.halves)

    head = product  # the output projection: a product like any other

    @staticmethod
    def activation(sizes: list[int], exact: list[bool]) -> Callable:
        """silu(gate) * up over packed groups of `sizes` positions: MLX's kernel for the decode
        positions (`exact` groups, which come first in a step), numpy's sigmoid for the prompt
        chunks after them where MLX's kernels are not built for this CPU."""
        silu_mul = cpu_kernels.silu_mul
        if sum(sizes) == 1 or not cpu_kernels.numpy_silu():
            return silu_mul
        lead = 0  # packed positions of the leading exact groups
        for size, is_exact in zip(sizes, exact, strict=True):
            if not is_exact:
                break
            lead += size
        # all decode positions, or some after a chunk: MLX's for all
        if lead == sum(sizes) or lead < sum(n for n, e in zip(sizes, exact, strict=True) if e):
            return silu_mul
        if lead == 0:
            return cpu_kernels.swiglu

        def split_silu(gate: mx.array, up: mx.array) -> mx.array:
            head = silu_mul(gate[:lead], up[:lead])
            return mx.concatenate([head, cpu_kernels.swiglu(gate[lead:], up[lead:])], 0)

        return split_silu

    @staticmethod
    def attention(layer, queries, keys, values, mask, view, starts: list[int], exact: bool):
        """queries [B, H, q, Dh] over the keys/values `view.update_and_fetch` returned ->
        [B, H, q, Dh]. Decode positions (`exact`) on the engine's rows (`view`: a RowView)
        read a span of whole SPAN blocks and take decode_attention's arithmetic; large prompt
        chunks go through numpy's softmax; the rest is MLX's fused attention."""
        b, nh, q, _ = queries.shape
        if exact and view is not None:
            width = decode_attention.span(view.plan.kv_len, view.store.capacity)
            keys, values = decode_attention.read(view, width)
            at = decode_attention.mask(mx.array(starts, dtype=mx.int32), q, width)
            return decode_attention.attend(queries, keys, values, at, layer.scale)
        if q > 1 and b * nh * q * keys.shape[2] >= cpu_kernels.NUMPY_MIN_ELEMENTS:
            return cpu_kernels.attention(queries, keys, values, layer.scale, mask)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )

    @staticmethod
    def decode_attention(layer, queries, keys, values, mask) -> mx.array:
        """A compiled decode step's attention: queries [B, H, 1, Dh] over the span read of
        keys/values [B, KV, span, Dh], mask [B, 1, 1, span] -> [B, H * Dh], the arithmetic
        of every decode position (decode_attention.attend_grouped)."""
        b, nh, _, hd = queries.shape
        nkv = keys.shape[1]
        grouped = queries.reshape(b, nkv, nh // nkv, hd)
        out = decode_attention.attend_grouped(grouped, keys, values, mask, layer.scale)
        return out.reshape(b, nh * hd)


class OpsAttention:
    """A group's attention as the native decode ops (three primitives per layer; or, where the
    forward has whole layers, a decode layer as four: `whole_layer`) over a store's per-layer
    arrays `keys`/`values` ([R, KV, capacity, Dh] each, replaced by the ops' outputs), rows
    and pos int32 [B] (row b's q new positions at pos[b]..pos[b] + q - 1). The eager forward
    passes the engine's store lists, the compiled step its graph inputs."""

    def __init__(self, ops, rotation, keys: list, values: list, rows, pos, q: int, allocate):
        self.ops, self.rotation, self.keys, self.values = ops, rotation, keys, values
        self.rows, self.pos, self.q = rows, pos, q
        self.allocate = allocate  # (index, layer): a layer's arrays where they are still None

    def __call__(self, layer, i: int, qkv: mx.array) -> mx.array:
        """qkv [B * q, (H + 2 KV) * Dh] -> [B * q, H * Dh]."""
        if self.keys[i] is None:
            self.allocate(i, layer)
        out, self.keys[i], self.values[i] = decode_attention.attend_ops(
            self.ops, layer, qkv, self.keys[i], self.values[i], self.rows, self.pos,
            self.rotation, self.q,
        )  # fmt: skip
        return out

    def whole_layer(self, layer, i: int, x: mx.array) -> mx.array:
        """x [B, dim] through a decode layer (q = 1) as four ops (decode_ops.whole_layer)."""
        if self.keys[i] is None:
            self.allocate(i, layer)
        rot = self.rotation
        x, self.keys[i], self.values[i] = decode_ops.whole_layer(
            self.ops, layer, x, self.keys[i], self.values[i], self.rows, self.pos,
            rot.cos2, rot.sin2,
        )  # fmt: skip
        return x
