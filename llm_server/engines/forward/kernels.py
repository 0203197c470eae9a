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

Each set is an object of functions, the arithmetic of a fused layer (`KernelSet.functions`:
norm, the stacked products, activation, attention, the output head) that the one forward
(engines/forward/fused.py) calls: `GenericKernels` here, `LinuxCPUKernels` with the native code
(llm_server/native/cpu_set.py). The native decode ops and the skinny library stay optional
inside `linux_cpu`: where they did not build, the same set runs the MLX-op forms of the same
arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import ScoreChunkResult
from llm_server.engines.forward.score_reduce import log_softmax, reduce_logits_mlx, reduce_logprobs
from llm_server.native import mlx_lm_patches
from llm_server.native.cpu_kernels import silu_mul

ENV = "LLM_SERVER_KERNELS"
LINUX_CPU = "linux_cpu"
GENERIC = "generic"
NAMES = (LINUX_CPU, GENERIC)


class GenericKernels:
    """The generic set's functions: plain MLX ops, what Metal runs. The interface every set
    implements (duck-typed; native/cpu_set.py: LinuxCPUKernels); `split` is always False here
    (the generic set splits no product) and `ops` always None (no native decode ops)."""

    name = GENERIC

    @staticmethod
    def decode_ops(layers: list, table: mx.array | None):
        """The native decode ops the layers attend through (None: MLX ops)."""
        return None

    @staticmethod
    def whole_layers(layers: list, ops) -> bool:
        """Whether a decode step runs each layer as one native call (the sets that may say yes
        also give `whole_layer(attention, split)`: that call, or None for op by op)."""
        return False

    @staticmethod
    def splits(positions: int) -> bool:
        """Whether a forward over `positions` splits its products over two streams."""
        return False

    @staticmethod
    def split_threads(split: bool):
        """A context the split products of one forward run in (nothing to hold here)."""
        return nullcontext()

    @staticmethod
    def hold_split(split: bool) -> None:
        """A decode step splitting its products starts (a pipelined step: until released)."""

    @staticmethod
    def release_split(split: bool) -> None:
        """The step `hold_split` saw is finished or dropped."""

    @staticmethod
    def patch_mlx_lm(model) -> None:
        """mlx-lm's own attention and SwiGLU for the model's family (a linux_cpu engine loaded
        before may have patched the module, which every model of the family shares)."""
        mlx_lm_patches.install(model, False)

    @staticmethod
    def split_mlx_lm(model) -> None:
        """Products of a model outside the fused layers as they are."""

    @staticmethod
    def mlx_lm_head(layer, tied: bool, hidden: mx.array) -> mx.array:
        """The model's output projection `layer` (`tied`: the embedding's `as_linear`)."""
        return layer.as_linear(hidden) if tied else layer(hidden)

    @staticmethod
    def norm(module, x: mx.array, ops) -> mx.array:
        """The layer's RMSNorm module, [T, dim] -> [T, dim]."""
        return module(x)

    @staticmethod
    def product(linear, x: mx.array, split: bool) -> mx.array:
        """x [T, in] @ linear [out, in].T (+ bias) -> [T, out]."""
        out = x @ linear.wt
        return out if linear.bias is None else out + linear.bias

    @classmethod
    def add_product(cls, x: mx.array, linear, a: mx.array, split: bool, decode: bool) -> mx.array:
        """x + a @ linear (the residual of the o and down products)."""
        return x + cls.product(linear, a, split)

    @classmethod
    def pair(cls, linear, x: mx.array, split: bool) -> tuple[mx.array, mx.array]:
        """The gate and up halves of the stacked gate/up product."""
        gate, up = mx.split(cls.product(linear, x, split), 2, axis=-1)
        return gate, up

    head = product  # the output projection

    @staticmethod
    def activation(sizes: list[int], exact: list[bool]) -> Callable:
        """silu(gate) * up for a step of packed groups of `sizes` positions (`exact`: the
        decode positions among them)."""
        return silu_mul

    @staticmethod
    def attention(layer, queries, keys, values, mask, view, starts: list[int], exact: bool):
        """queries [B, H, q, Dh] over keys/values [B, KV, kv_len, Dh] with the plan's mask ->
        [B, H, q, Dh] (`view`: the engine's RowView or None; `exact`: decode positions)."""
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )

    @staticmethod
    def decode_attention(layer, queries, keys, values, mask) -> mx.array:
        """A compiled decode step's attention: queries [B, H, 1, Dh] over keys/values
        [B, KV, span, Dh] with mask [B, 1, 1, span] bool -> [B, H * Dh]."""
        b, nh, _, hd = queries.shape
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.scale, mask=mask
        )
        return out.reshape(b, nh * hd)


def _functions(name: str):
    if name == LINUX_CPU:
        from llm_server.native.cpu_set import LinuxCPUKernels

        return LinuxCPUKernels()
    return GenericKernels()


@dataclass(frozen=True)
class KernelSet:
    """Which kernels an engine's forwards use (see the module docstring): `functions`, the
    arithmetic the forward calls, and the choices engine code makes once (`rope_table`,
    `pipeline`...), never the device; under `linux_cpu` each choice is on, under `generic` off."""

    name: str
    functions: object = field(init=False, compare=False, repr=False)

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
