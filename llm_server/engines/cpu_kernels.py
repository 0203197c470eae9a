"""CPU fast paths for the transcendental parts of a forward (softmax, SwiGLU, log-softmax).

MLX's CPU backend evaluates exp/sigmoid one element at a time (~11 ns per element here), while
numpy's SIMD exp takes ~0.5 ns. For a 500-token prefill that made attention's softmax and the
MLP's SiLU half of the time. For large tensors these helpers evaluate the input, do the
transcendental part in numpy and hand the result back to the MLX graph (two ~0.1 ms copies);
small tensors (a decode step at short context) stay in MLX, where a sync would cost more.
`install()` points mlx-lm's model module at them; it does nothing unless MLX runs on the CPU.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

NUMPY_MIN_ELEMENTS = 32_768  # below this an MLX op beats a round trip through numpy
_INSTALLED: set[str] = set()


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _np_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place ([..., S] float32)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """Grouped-query attention: q [B, H, L, D], k/v [B, KV, S, D] -> [B, H, L, D].

    `mask` is None, "causal" (lower-right aligned) or a bool/additive array broadcastable to
    [B, 1, L, S]. Keys are never repeated per head: query heads are folded into rows instead.
    """
    b, h, length, d = queries.shape
    kv, s = keys.shape[1], keys.shape[2]
    rep = h // kv
    q = (queries * scale).reshape(b, kv, rep * length, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, kv, rep, length, s)
    if isinstance(mask, str):
        mask = mx.arange(s - length, s)[:, None] >= mx.arange(s)[None]
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[:, :, None]  # [B, 1, 1, L, S] against [B, KV, rep, L, S]
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-np.inf, scores.dtype))
        else:
            scores = scores + mask
    if scores.dtype == mx.float32:
        probs = mx.array(_np_softmax(np.array(scores)))
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.reshape(b, kv, rep * length, s) @ values
    return out.reshape(b, h, length, d)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, with the sigmoid in numpy for large float32 inputs."""
    if gate.size < NUMPY_MIN_ELEMENTS or gate.dtype != mx.float32:
        return mx.sigmoid(gate) * gate * x
    g = np.array(gate)
    sig = np.exp(-g)
    sig += 1.0
    np.divide(g, sig, out=g)  # silu(g) = g / (1 + exp(-g))
    return mx.array(g) * x


def log_softmax(logits: mx.array) -> np.ndarray:
    """log-softmax over the last axis as a float32 numpy array (scoring reductions)."""
    z = np.array(logits.astype(mx.float32))
    m = z.max(axis=-1, keepdims=True)
    z -= m
    lse = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    z -= lse
    return z


def install(model) -> bool:
    """Route the model module's attention and SwiGLU through these helpers (CPU only)."""
    if not on_cpu():
        return False
    module = sys.modules[type(model).__module__]
    if module.__name__ in _INSTALLED:
        return True
    original_sdpa = getattr(module, "scaled_dot_product_attention", None)
    if original_sdpa is not None:

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            b, h, length, _ = queries.shape
            big = b * h * length * keys.shape[2] >= NUMPY_MIN_ELEMENTS
            if not big or sinks is not None or hasattr(cache, "bits") or not on_cpu():
                return original_sdpa(
                    queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
                )
            return attention(queries, keys, values, scale, mask)

        module.scaled_dot_product_attention = sdpa
    original_swiglu = getattr(module, "swiglu", None)
    if original_swiglu is not None:
        module.swiglu = lambda gate, x: swiglu(gate, x) if on_cpu() else original_swiglu(gate, x)
    _INSTALLED.add(module.__name__)
    return True
