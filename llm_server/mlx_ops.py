"""Plain MLX functions both kernel sets use: the generic set (engines/forward/kernels.py) and the
Linux-CPU set (native/cpu_set.py). A neutral place: it imports neither, so the generic set
needs nothing from native/ and native/ nothing from the engines.

- `silu_mul`: silu(gate) * up as one fused kernel;
- `SPAN`, `span`, `mask`: the fixed span of store positions a compiled decode step's attention
  reads (native/decode_attention.py says why its arithmetic wants whole SPAN blocks);
- `PATCHED`: which mlx-lm model modules run a kernel set's replacements (native/
  mlx_lm_patches.py installs them; `use_mlx_lm_own` turns them off for a family again).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

# attention reads each row's first `span` store positions, span = the step's longest history
# rounded up to this: softmax's exp costs ~12 ns per position on the CPU, so reading the whole
# capacity (up to GROW - 1 masked positions) costs more than a new compiled graph every SPAN
# tokens (a trace takes ~15 ms, once per SPAN tokens of the longest row)
SPAN = 64

# model module -> whether a kernel set's attention/SwiGLU replacements are on (the module is
# shared by every model of its family in the process: the engine loaded last decides)
PATCHED: dict[str, bool] = {}


@partial(mx.compile, shapeless=True)
def silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x as one fused kernel (the decode positions' SiLU, and every position's
    where the CPU set's `numpy_silu()` is False; the generic set's SiLU)."""
    return gate * mx.sigmoid(gate) * x


def span(positions: int, capacity: int) -> int:
    """Store positions attention reads when the longest row of a group holds `positions`
    (its new ones included): rounded up to SPAN, at most the store's capacity."""
    return min(capacity, -(-positions // SPAN) * SPAN)


def mask(starts: mx.array, q: int, width: int) -> mx.array:
    """[B, 1, q, width] bool: query i of row b sees store positions 0..starts[b] + i."""
    at = starts[:, None] + mx.arange(q)[None, :]  # [B, q]
    return (mx.arange(width)[None, None, :] <= at[:, :, None])[:, None]


def use_mlx_lm_own(model) -> None:
    """mlx-lm's own attention and SwiGLU for the model's family, where a kernel set patched
    the family's module before (a linux_cpu engine loaded earlier in the process)."""
    name = type(model).__module__
    if name in PATCHED:
        PATCHED[name] = False
