"""The kernel set an engine runs: chosen once, when the engine loads.

- `linux_cpu`: the Linux-CPU workshop (llm_server/native). Decode steps compiled with the CPU's
  decode attention (native/decode_attention.py, the native decode ops where they built), a
  rotary cos/sin table, products split over two CPU streams or run by the skinny library,
  numpy's softmax/SiLU/log-softmax for large tensors (native/cpu_kernels.py), quantized
  checkpoints dequantized to float32, no pipelining.
- `generic`: plain MLX ops, what Metal (and any other device) runs: mlx-lm's rope and
  `mx.fast.scaled_dot_product_attention`, eager decode steps, MLX's log-softmax, pipelined
  greedy steps, quantized layers kept quantized.

The default is `linux_cpu` where MLX runs on the CPU and `generic` elsewhere; the environment
variable LLM_SERVER_KERNELS (or `EngineSettings(kernels=...)`) overrides it, so the generic set (every
branch a Mac takes) runs on this machine's CPU too (`make test` runs the engine suite under
both). `linux_cpu` needs MLX on the CPU. Exactness is promised per set: under `linux_cpu` a row's
logits do not depend on batching, mixing or compiling, bit for bit (S10); the generic set keeps
that promise on Metal's terms, which the tests on the CPU check to a stated tolerance where MLX's
fused attention rounds differently per shape.

Each set is one object (`KernelSet.functions`) behind a closed interface (the Protocols below:
`Kernels` -> `FusedKernels` -> `ForwardContext`): a fused forward gets its kernels from the set,
and from them the context of each forward over its positions; the context builds the groups'
attention objects and holds the arithmetic of a fused layer (norm, the stacked products,
activation, attention, the output head) that the one forward (engines/forward/fused.py) calls.
`GenericKernels` is here (plain MLX ops; its context holds nothing), `LinuxCPUKernels` with the
native code (llm_server/native/cpu_set.py: its context splits products over two CPU streams,
the native decode ops attend), imported only by the registry (`_functions`). The native decode
ops and the skinny library stay optional inside `linux_cpu`: where they did not build, the same
set runs the MLX-op forms of the same arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from llm_server import mlx_ops
from llm_server.engines.contract import ScoreChunkResult
from llm_server.engines.forward.compiled import GraphAttention, StepShape, reader, writer
from llm_server.engines.forward.fused import ViewAttention
from llm_server.engines.forward.layers import Rotation
from llm_server.engines.forward.score_reduce import log_softmax, reduce_logits_mlx, reduce_logprobs

ENV = "LLM_SERVER_KERNELS"
LINUX_CPU = "linux_cpu"
GENERIC = "generic"
NAMES = (LINUX_CPU, GENERIC)


# -- the interface: what the engines call on a kernel set ------------------------------------


class Attention(Protocol):
    """A group's attention in one forward (engines/forward/layers.py: Group.attention)."""

    # (layer, index, x [rows, dim]) -> x': a decode layer as one call of the set, where this
    # attention runs whole layers (None: the forward runs the layer op by op)
    whole_layer: Callable | None

    def __call__(self, layer, i: int, qkv: mx.array) -> mx.array:
        """qkv [rows * q, (H + 2 KV) * Dh] -> [rows * q, H * Dh], writing the new keys and
        values into the group's store."""
        ...


class ForwardContext(Protocol):
    """One forward's kernels: the arithmetic of a fused layer and the attention objects of the
    forward's groups. Entered (`with`) while the forward is built and evaluated; a compiled
    graph traced with it serves every context of the same `key`."""

    key: Hashable

    def __enter__(self) -> ForwardContext: ...

    def __exit__(self, *exc) -> None: ...

    def attention(
        self, caches: list, starts: list[int], mask, q: int, exact: bool, rows: list[int] | None
    ) -> Attention:
        """The attention of a group of `q` new positions per row from `starts` over `caches`
        (`rows`: the engine's store rows the caches view; None: mlx-lm caches)."""
        ...

    def graph_attention(
        self, keys: list, values: list, pos: mx.array, row_ids: mx.array, shape: StepShape
    ) -> Attention:
        """A compiled decode step's attention over the store arrays `keys`/`values` (the graph's
        inputs, replaced by the written ones)."""
        ...

    def norm(self, module, x: mx.array) -> mx.array:
        """The layer's RMSNorm module, [T, dim] -> [T, dim]."""
        ...

    def product(self, linear, x: mx.array) -> mx.array:
        """x [T, in] @ linear [out, in].T (+ bias) -> [T, out]."""
        ...

    def add_product(self, x: mx.array, linear, a: mx.array, decode: bool) -> mx.array:
        """x + a @ linear (the residual of the o and down products; `decode`: a decode-only
        step)."""
        ...

    def pair(self, linear, x: mx.array) -> tuple[mx.array, mx.array]:
        """The gate and up halves of the stacked gate/up product."""
        ...

    def head(self, linear, x: mx.array) -> mx.array:
        """The output projection."""
        ...

    def activation(self, sizes: list[int], exact: list[bool]) -> Callable:
        """silu(gate) * up for a step of packed groups of `sizes` positions (`exact`: the
        decode positions among them)."""
        ...

    def attend(self, layer, queries, keys, values, mask, view, starts: list[int], exact: bool):
        """queries [B, H, q, Dh] over keys/values [B, KV, kv_len, Dh] with the plan's mask ->
        [B, H, q, Dh] (`view`: the engine's RowView or None; `exact`: decode positions)."""
        ...

    def attend_graph(self, layer, queries, keys, values, mask) -> mx.array:
        """A compiled decode step's attention: queries [B, H, 1, Dh] over keys/values
        [B, KV, span, Dh] with mask [B, 1, 1, span] bool -> [B, H * Dh]."""
        ...


class FusedKernels(Protocol):
    """A kernel set's kernels for one fused forward (its layers and rotation table)."""

    def context(self, positions: int) -> ForwardContext:
        """The context of a forward over `positions` (rows x new tokens)."""
        ...

    def graph_span(self, positions: int, capacity: int) -> int:
        """Store positions per row a compiled decode step's attention reads when its longest
        row holds `positions` (0: every row's own history, one graph for any history and any
        rows)."""
        ...


class Kernels(Protocol):
    """A kernel set: `GenericKernels` here, `LinuxCPUKernels` in native/cpu_set.py."""

    name: str

    def fused(
        self, layers: list, table: mx.array | None, rotation: Rotation | None, native: bool
    ) -> FusedKernels:
        """The kernels of a fused forward over `layers` rotating by `table` (`native`: the
        set's own attention code may run, where it has some)."""
        ...

    def prepare_mlx_lm(self, model, layers: bool) -> None:
        """The set's forms of mlx-lm's modules in `model` (`layers`: mlx-lm's forward runs the
        decoder layers, with a plain head)."""
        ...

    def mlx_lm_head(self, layer, tied: bool, hidden: mx.array) -> mx.array:
        """The model's output projection `layer` (`tied`: the embedding's `as_linear`)."""
        ...

    def thread_exit(self) -> None:
        """The thread driving the engine ends (its MLX streams finished and freed)."""
        ...


# -- the generic set ----------------------------------------------------------------------


class MLXAttention:
    """The attention objects of MLX ops (q/k norms, rotation, the cache's write and read) with
    a context's arithmetic (`attend`, `attend_graph`): every group of the generic set, and the
    Linux-CPU set's groups its native code does not take."""

    @staticmethod
    def view(context, caches, starts, mask, q: int, exact: bool, rotation) -> ViewAttention:
        at = None if rotation is None else rotation.at(starts, q)
        return ViewAttention(context, caches, starts, mask, at, exact)

    @staticmethod
    def graph(context, keys, values, pos, row_ids, shape: StepShape, rotation) -> GraphAttention:
        return GraphAttention(
            context,
            keys,
            values,
            mlx_ops.mask(pos, 1, shape.span),  # [B, 1, 1, span]
            rotation,
            pos,
            writer(shape, pos, row_ids),
            reader(shape, row_ids),
            shape.kv,
        )


class GenericContext:
    """The generic set's forward context: plain MLX ops, nothing held."""

    key = None

    def __init__(self, rotation: Rotation | None) -> None:
        self.rotation = rotation

    def __enter__(self) -> GenericContext:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def attention(self, caches, starts, mask, q, exact, rows) -> ViewAttention:
        return MLXAttention.view(self, caches, starts, mask, q, exact, self.rotation)

    def graph_attention(self, keys, values, pos, row_ids, shape) -> GraphAttention:
        return MLXAttention.graph(self, keys, values, pos, row_ids, shape, self.rotation)

    @staticmethod
    def norm(module, x: mx.array) -> mx.array:
        return module(x)

    @staticmethod
    def product(linear, x: mx.array) -> mx.array:
        out = x @ linear.wt
        return out if linear.bias is None else out + linear.bias

    @classmethod
    def add_product(cls, x: mx.array, linear, a: mx.array, decode: bool) -> mx.array:
        return x + cls.product(linear, a)

    @classmethod
    def pair(cls, linear, x: mx.array) -> tuple[mx.array, mx.array]:
        gate, up = mx.split(cls.product(linear, x), 2, axis=-1)
        return gate, up

    head = product  # the output projection

    @staticmethod
    def activation(sizes: list[int], exact: list[bool]) -> Callable:
        return mlx_ops.silu_mul

    @staticmethod
    def attend(layer, queries, keys, values, mask, view, starts: list[int], exact: bool):
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )

    @staticmethod
    def attend_graph(layer, queries, keys, values, mask) -> mx.array:
        b, nh, _, hd = queries.shape
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )
        return out.reshape(b, nh * hd)


class GenericFused:
    """The generic set's kernels of a fused forward: one context for any forward."""

    def __init__(self, rotation: Rotation | None) -> None:
        self.rotation = rotation
        self._context = GenericContext(rotation)

    def context(self, positions: int) -> GenericContext:
        return self._context

    @staticmethod
    def graph_span(positions: int, capacity: int) -> int:
        return mlx_ops.span(positions, capacity)


class GenericKernels:
    """The generic set: plain MLX ops, what Metal runs (the interface: `Kernels`)."""

    name = GENERIC

    @staticmethod
    def fused(layers, table, rotation, native: bool) -> GenericFused:
        return GenericFused(rotation)

    @staticmethod
    def prepare_mlx_lm(model, layers: bool) -> None:
        """mlx-lm's own attention and SwiGLU for the model's family (a linux_cpu engine loaded
        before may have patched the module, which every model of the family shares)."""
        mlx_ops.use_mlx_lm_own(model)

    @staticmethod
    def mlx_lm_head(layer, tied: bool, hidden: mx.array) -> mx.array:
        return layer.as_linear(hidden) if tied else layer(hidden)

    @staticmethod
    def thread_exit() -> None:
        """On the CPU, this thread's work finished and its streams freed: a CPU thread that
        ended without it aborted the process at exit ~1 run in 4 (Metal: nothing)."""
        if mx.default_device() == mx.cpu:
            mx.synchronize()
            mx.clear_streams()


def _functions(name: str) -> Kernels:
    """The set's object: the one place the Linux-CPU set (native/) is imported."""
    if name == LINUX_CPU:
        from llm_server.native.cpu_set import LinuxCPUKernels

        return LinuxCPUKernels(MLXAttention)
    return GenericKernels()


@dataclass(frozen=True)
class KernelSet:
    """Which kernels an engine's forwards use (see the module docstring): `functions`, the
    arithmetic the forward calls, and the choices engine code makes once (`rope_table`,
    `pipeline`...), never the device; under `linux_cpu` each choice is on, under `generic` off."""

    name: str
    functions: Kernels = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "functions", _functions(self.name))

    @property
    def linux_cpu(self) -> bool:
        return self.name == LINUX_CPU

    def __str__(self) -> str:
        return self.name

    @property
    def rope_table(self) -> bool:
        """Fused layers rotate by a cos/sin table (MLX's CPU rope recomputes cos/sin per call;
        Metal's rope kernel is fast); with it, the native decode ops where they built."""
        return self.linux_cpu

    @property
    def numpy_large(self) -> bool:
        """Large softmax/SiLU/log-softmax in numpy (the set's `patch_mlx_lm` for mlx-lm's
        modules, `reduce_scores` here)."""
        return self.linux_cpu

    @property
    def compiled_decode(self) -> bool:
        """Pure decode steps compiled by default (bit-equal to eager under this set)."""
        return self.linux_cpu

    @property
    def pipeline(self) -> bool:
        """Greedy decode steps pipelined by default (on the CPU the Python work would compete
        with the forward for the same cores)."""
        return not self.linux_cpu

    @property
    def dequantize(self) -> bool:
        """Quantized checkpoints dequantized to float32 at load (MLX's CPU quantized products
        are slow; Metal's are fast)."""
        return self.linux_cpu

    def reduce_scores(
        self, logits: mx.array | np.ndarray, targets: np.ndarray, top_k: int
    ) -> ScoreChunkResult:
        """Scoring positions' logits [N, q, vocab] -> log-probs of the targets, top-k, greedy
        ids (C3): linux_cpu in numpy (SIMD exp, in place on a float32 copy), generic with MLX's
        ops on the device before anything leaves it."""
        if self.numpy_large:
            if isinstance(logits, mx.array):
                z = np.array(logits.astype(mx.float32))
            else:
                z = np.array(logits, dtype=np.float32)
            return reduce_logprobs(log_softmax(z), targets, top_k)
        return reduce_logits_mlx(mx.array(logits), targets, top_k)


def default_name() -> str:
    """The set this process runs when nothing is asked for: linux_cpu on the CPU."""
    return LINUX_CPU if mx.default_device() == mx.cpu else GENERIC


def resolve(choice: str | None = None, env: dict[str, str] | None = None) -> KernelSet:
    """The kernel set for `choice` (None: LLM_SERVER_KERNELS, else the default)."""
    env = os.environ if env is None else env
    name = (choice or env.get(ENV) or "").strip().lower() or default_name()
    if name not in NAMES:
        source = "kernels" if choice else ENV
        raise ValueError(f"{source} must be one of {', '.join(NAMES)}, got {name!r}")
    if name == LINUX_CPU and mx.default_device() != mx.cpu:
        raise ValueError("the linux_cpu kernel set needs MLX on the CPU")
    return KernelSet(name)
