"""The kernel set an engine runs: chosen once, when the engine loads.

- `linux_cpu`: the Linux-CPU workshop. Decode steps compiled with the CPU's decode attention
  (decode_attention, the native decode ops where they built), a rotary cos/sin table, products
  split over two CPU streams or run by the skinny library, numpy's softmax/SiLU/log-softmax for
  large tensors (cpu_kernels), quantized checkpoints dequantized to float32, no pipelining.
- `generic`: plain MLX ops, what Metal (and any other device) runs: mlx-lm's rope and
  `mx.fast.scaled_dot_product_attention`, eager decode steps, MLX's log-softmax, pipelined
  greedy steps, quantized layers kept quantized.

The default is `linux_cpu` where MLX runs on the CPU and `generic` elsewhere; the environment
variable LLM_SERVER_KERNELS (or `MLXEngine(kernels=...)`) overrides it, so the generic set (every
branch a Mac takes) runs on this machine's CPU too (`make test` runs the engine suite under
both). `linux_cpu` needs MLX on the CPU. Exactness is promised per set: under `linux_cpu` a row's
logits do not depend on batching, mixing or compiling, bit for bit (S10); the generic set keeps
that promise on Metal's terms, which the tests on the CPU check to a stated tolerance where MLX's
fused attention rounds differently per shape.

The native decode ops and the skinny library stay optional inside `linux_cpu`, as before: where
they did not build, the same set runs the MLX-op forms of the same arithmetic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from llm_server.engines.base import ScoreChunkResult
from llm_server.engines.score_reduce import log_softmax, reduce_logits_mlx, reduce_logprobs

ENV = "LLM_SERVER_KERNELS"
LINUX_CPU = "linux_cpu"
GENERIC = "generic"
NAMES = (LINUX_CPU, GENERIC)


@dataclass(frozen=True)
class KernelSet:
    """Which kernels an engine's forwards use (see the module docstring). Engine code asks for
    the choice it makes (`rope_table`, `pipeline`...), never for the device; under `linux_cpu`
    each is on, under `generic` each is off."""

    name: str

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
    def decode_attention(self) -> bool:
        """Decode positions attend with decode_attention's arithmetic (compiled, mixed or
        eager alike), not `mx.fast.scaled_dot_product_attention`."""
        return self.linux_cpu

    @property
    def numpy_large(self) -> bool:
        """Large softmax/SiLU in numpy (cpu_kernels), mlx-lm's modules patched to match."""
        return self.linux_cpu

    @property
    def split_products(self) -> bool:
        """1-2 row products split over two CPU streams where the skinny library is not loaded
        (SplitLinear, the split head, `MLXEngine._split`)."""
        return self.linux_cpu

    @property
    def addmm(self) -> bool:
        """The compiled step adds a product's residual inside the product (one op fewer)."""
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
