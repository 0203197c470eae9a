"""CPU fast paths (numpy softmax/SiLU/log-softmax) equal MLX's own ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

from llm_server.engines.forward import score_reduce
from llm_server.native import cpu_kernels as native_kernels


@pytest.mark.parametrize(
    ("batch", "length", "keys", "mask"),
    [(1, 200, 200, "causal"), (1, 64, 256, "causal"), (4, 1, 300, "bool"), (2, 3, 40, None)],
)
def test_attention_matches_mlx_fast_sdpa(batch, length, keys, mask):
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((batch, 6, length, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((batch, 2, keys, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((batch, 2, keys, 16)).astype(np.float32))
    if mask == "bool":
        cursors = mx.array([keys - 1, keys // 2, 7, 0])[:batch]
        mask = (mx.arange(keys)[None, :] <= cursors[:, None])[:, None, None, :]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = native_kernels.attention(q, k, v, 0.25, mask)
    assert float(mx.abs(got - want).max()) <= 1e-5


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_attention_with_an_additive_mask_matches_mlx_fast_sdpa(dtype):
    """A float mask is added to the scores (-inf hides a key); half-precision scores take
    MLX's precise softmax instead of numpy's."""
    rng = np.random.default_rng(1)
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in ((2, 6, 3, 16), (2, 2, 40, 16), (2, 2, 40, 16))
    )
    bias = rng.standard_normal((2, 1, 3, 40)).astype(np.float32)
    bias[0, :, :, 30:] = -np.inf  # row 0 sees its first 30 keys only
    mask = mx.array(bias).astype(dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = native_kernels.attention(q, k, v, 0.25, mask)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 4e-3
    assert float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()) <= tol
    unmasked = native_kernels.attention(q, k, v, 0.25, None)
    assert float(mx.abs(unmasked.astype(mx.float32) - got.astype(mx.float32)).max()) > 0.1


@pytest.mark.parametrize("rows", [3, 200])  # below and above the numpy threshold
def test_swiglu_matches_mlx_lm(rows):
    rng = np.random.default_rng(1)
    gate = mx.array(rng.standard_normal((rows, 512)).astype(np.float32) * 4)
    x = mx.array(rng.standard_normal((rows, 512)).astype(np.float32))
    assert float(mx.abs(native_kernels.swiglu(gate, x) - mlx_swiglu(gate, x)).max()) <= 1e-5


def test_log_softmax_matches_mlx():
    logits = mx.array(np.random.default_rng(2).standard_normal((2, 5, 1000)).astype(np.float32) * 9)
    want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert np.abs(score_reduce.log_softmax(np.array(logits)) - want).max() <= 1e-5
