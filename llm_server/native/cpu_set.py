"""The Linux-CPU kernel set: the arithmetic of a fused layer as the CPU runs it fastest with
one rounding per position, whatever step it rides in (see engines/forward/kernels.py for the interface
and the generic MLX set beside it).

- norms: the decode ops' RMSNorm (one op, `mx.fast.rms_norm`'s values bit for bit) where the
  model's layers take the decode ops;
- products: 1-2 row products split over two CPU streams where the forward's context says so
  (`CPUContext.split`: BLIS runs such skinny products on one core), a decode step's residual
  added inside its product;
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
    """The linux_cpu set (engines/forward/kernels.py: the `Kernels` interface), one instance per
    engine: its only state is the count of split forwards in flight (`CPUContext`)."""

    name = "linux_cpu"

    def __init__(self, mlx) -> None:
        """`mlx`: the MLX-op attention objects (engines/forward/kernels.py: MLXAttention), for the
        groups the native decode ops do not take (given by the set's registry: the native
        folder never imports the engines)."""
        self.mlx = mlx
        self.held = 0  # split forwards in flight (BLIS held to one thread meanwhile)

    def fused(self, layers: list, table: mx.array | None, rotation, native: bool) -> CPUFused:
        return CPUFused(self, layers, table, rotation, native)

    # -- mlx-lm's forward, for families outside the fused layers --

    @staticmethod
    def prepare_mlx_lm(model, layers: bool) -> None:
        """Route the model family's attention and SwiGLU through numpy for large tensors
        (mlx_lm_patches.install); where mlx-lm's forward runs the decoder layers (`layers`),
        swap their float nn.Linear modules for ones whose 1-2 row products are split over two
        streams."""
        mlx_lm_patches.install(model, True)
        if layers:
            mlx_lm_patches.split_linears(model)

    @staticmethod
    def mlx_lm_head(layer, tied: bool, hidden: mx.array) -> mx.array:
        """The model's output projection `layer` (`tied`: the embedding's `as_linear`) over
        hidden [..., dim], split over two streams for a 1-2 row decode step."""
        return mlx_lm_patches.lm_head(layer, tied, hidden, True)

    @staticmethod
    def thread_exit() -> None:
        """This thread's split streams finished and destroyed (cpu_kernels.release_streams)."""
        cpu_kernels.release_streams()

    # -- split forwards in flight --

    def hold(self) -> None:
        """A split forward starts: BLIS on one thread until `release` (a pipelined step is
        finished later, and the next may start before)."""
        self.held += 1
        blas.set_threads(1)

    def release(self) -> None:
        """A forward `hold` saw is finished or dropped: BLIS's own threads once none is left."""
        self.held -= 1
        if self.held == 0:
            blas.set_threads(blas.default_threads())


class CPUFused:
    """The linux_cpu set's kernels of one fused forward: the native decode ops where every
    position of these layers may attend through them (`ops`), whether a decode step may run
    each layer as four of them (`whole_layers`), whether its products may split (float32)."""

    def __init__(
        self, kernels: LinuxCPUKernels, layers: list, table: mx.array | None, rotation, native
    ) -> None:
        self.kernels, self.rotation = kernels, rotation
        self.ops = _decode_ops(layers, table) if native else None
        self.whole_layers = _whole_layers(layers, self.ops)  # read when a step is built
        self.may_split = all(layer.qkv.weight.dtype == mx.float32 for layer in layers)

    def context(self, positions: int) -> CPUContext:
        return CPUContext(self, self.may_split and splits(positions))

    def graph_span(self, positions: int, capacity: int) -> int:
        """0 with the decode ops (they read each row's positions 0..p themselves), else
        decode_attention's span."""
        return 0 if self.ops is not None else decode_attention.span(positions, capacity)


def _decode_ops(layers: list, table: mx.array | None):
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


def _whole_layers(layers: list, ops) -> bool:
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


class CPUContext:
    """One forward under the linux_cpu set: its products split over two CPU streams or not
    (`split`, the compiled graph's key), BLIS held to one thread per stream while a split
    forward is entered; the arithmetic of its layers and its groups' attention."""

    def __init__(self, fused: CPUFused, split: bool) -> None:
        self.fused, self.ops, self.split = fused, fused.ops, split
        self.key = split

    def __enter__(self) -> CPUContext:
        if self.split:
            self.fused.kernels.hold()
        return self

    def __exit__(self, *exc) -> None:
        if self.split:
            self.fused.kernels.release()

    # -- attention objects --

    def _whole(self) -> bool:
        """A one-group decode step's layer as the decode ops' four, unless the step splits its
        products: the four ops run their own, unsplit."""
        return self.fused.whole_layers and not self.split

    def attention(self, caches, starts, mask, q: int, exact: bool, rows):
        """Through the decode ops where the forward has them and `caches` are the engine's
        rows (`rows`), else MLX ops with this context's `attend`."""
        fused = self.fused
        if self.ops is None or rows is None:
            return fused.kernels.mlx.view(self, caches, starts, mask, q, exact, fused.rotation)
        store = caches[0].store

        def allocate(i: int, layer) -> None:  # the first write since it was cleared
            store.allocate(i, layer.kv_heads, layer.head_dim, layer.head_dim, mx.float32)

        return OpsAttention(
            self.ops, fused.rotation, store.keys, store.values,
            mx.array(rows, dtype=mx.int32), mx.array(starts, dtype=mx.int32), q, allocate,
            self._whole(),
        )  # fmt: skip

    def graph_attention(self, keys: list, values: list, pos, row_ids, shape):
        """A compiled decode step's: the decode ops, else MLX ops with `attend_graph`."""
        fused = self.fused
        if self.ops is None:
            return fused.kernels.mlx.graph(self, keys, values, pos, row_ids, shape, fused.rotation)
        return OpsAttention(
            self.ops, fused.rotation, keys, values, row_ids, pos, 1, _allocated, self._whole()
        )

    # -- the layer's arithmetic --

    def norm(self, module, x: mx.array) -> mx.array:
        """RMSNorm: with the decode ops one op, MLX's values bit for bit (checked at load)."""
        ops = self.ops
        return module(x) if ops is None else ops.rms_norm(x, module.weight, module.eps)

    def product(self, linear, x: mx.array) -> mx.array:
        """x [T, in] @ linear [out, in].T (+ bias); `split`: the output halves on two streams."""
        split = self.split
        out = cpu_kernels.split_matmul_halves(x, linear.halves) if split else x @ linear.wt
        return out if linear.bias is None else out + linear.bias

    def add_product(self, x: mx.array, linear, a: mx.array, decode: bool) -> mx.array:
        """x + a @ linear: in a decode-only step one addmm (the product writes onto a copy of x,
        each output s + x as in the separate add: alpha = beta = 1), one op fewer."""
        if self.split or linear.bias is not None or not decode:
            return x + self.product(linear, a)
        return mx.addmm(x, a, linear.wt)

    def pair(self, linear, x: mx.array) -> tuple[mx.array, mx.array]:
        """The two halves of a stacked gate/up product, each on its own stream when `split`:
        no concatenation and no slicing of a joint output."""
        if linear.bias is not None or not self.split:
            gate, up = mx.split(self.product(linear, x), 2, axis=-1)
            return gate, up
        return cpu_kernels.split_matmuls(x, linear.halves)

    def head(self, linear, x: mx.array) -> mx.array:
        """The output projection: a product like any other."""
        return self.product(linear, x)

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
    def attend(layer, queries, keys, values, mask, view, starts: list[int], exact: bool):
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
    def attend_graph(layer, queries, keys, values, mask) -> mx.array:
        """A compiled decode step's attention: queries [B, H, 1, Dh] over the span read of
        keys/values [B, KV, span, Dh], mask [B, 1, 1, span] -> [B, H * Dh], the arithmetic
        of every decode position (decode_attention.attend_grouped)."""
        b, nh, _, hd = queries.shape
        nkv = keys.shape[1]
        grouped = queries.reshape(b, nkv, nh // nkv, hd)
        out = decode_attention.attend_grouped(grouped, keys, values, mask, layer.scale)
        return out.reshape(b, nh * hd)


def _allocated(i: int, layer) -> None:
    raise RuntimeError("a compiled step runs on a store that holds every layer")


class OpsAttention:
    """A group's attention as the native decode ops (three primitives per layer; or, where the
    forward has whole layers, a decode layer as four: `whole_layer`) over a store's per-layer
    arrays `keys`/`values` ([R, KV, capacity, Dh] each, replaced by the ops' outputs), rows
    and pos int32 [B] (row b's q new positions at pos[b]..pos[b] + q - 1). The eager forward
    passes the engine's store lists, the compiled step its graph inputs. `whole`: a decode
    step (q = 1) may run each layer as four ops (`whole_layer`, else None)."""

    def __init__(
        self, ops, rotation, keys: list, values: list, rows, pos, q: int, allocate, whole: bool
    ):
        self.ops, self.rotation, self.keys, self.values = ops, rotation, keys, values
        self.rows, self.pos, self.q = rows, pos, q
        self.allocate = allocate  # (index, layer): a layer's arrays where they are still None
        self.whole = whole

    @property
    def whole_layer(self):
        """`_whole_layer` where the step may run whole layers, else None. A property, not an
        attribute holding the bound method: that would be a reference cycle, and a compiled
        step's trace (whose lists hold a copy of the whole KV store) would then live until the
        garbage collector next ran (+46 MB held for SmolLM2 at 4 rows x 256 positions)."""
        return self._whole_layer if self.whole else None

    def __call__(self, layer, i: int, qkv: mx.array) -> mx.array:
        """qkv [B * q, (H + 2 KV) * Dh] -> [B * q, H * Dh]."""
        if self.keys[i] is None:
            self.allocate(i, layer)
        out, self.keys[i], self.values[i] = decode_attention.attend_ops(
            self.ops, layer, qkv, self.keys[i], self.values[i], self.rows, self.pos,
            self.rotation, self.q,
        )  # fmt: skip
        return out

    def _whole_layer(self, layer, i: int, x: mx.array) -> mx.array:
        """x [B, dim] through a decode layer (q = 1) as four ops (decode_ops.whole_layer)."""
        if self.keys[i] is None:
            self.allocate(i, layer)
        rot = self.rotation
        x, self.keys[i], self.values[i] = decode_ops.whole_layer(
            self.ops, layer, x, self.keys[i], self.values[i], self.rows, self.pos,
            rot.cos2, rot.sin2,
        )  # fmt: skip
        return x
