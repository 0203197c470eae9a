"""CPU fast paths for the transcendental parts of a forward (softmax, SwiGLU) and the products
split over two CPU streams: the Linux-CPU kernel set's helpers (native/cpu_set.py).

MLX's prebuilt CPU ops evaluate exp/sigmoid one element at a time, while numpy's SIMD exp is
some twenty times faster. For large tensors these helpers evaluate the input, do the
transcendental part in numpy and hand the result back to the MLX graph (a sync and two copies);
small tensors (a decode step at short context) stay in MLX, where a sync would cost more.
SwiGLU stays in MLX at any size where MLX builds its fused kernels for this CPU (native.jit:
exp and sigmoid in 16-float vectors, no sync). The softmax keeps numpy's in-place form: a long
scoring chunk's scores are held once, where MLX's graph holds them two or three times.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from llm_server.mlx_ops import silu_mul
from llm_server.native import jit, skinny

NUMPY_MIN_ELEMENTS = 32_768  # below this an MLX op beats a round trip through numpy
SPLIT_MAX_ROWS = 2  # BLIS runs a 1-2 row product on one core; from 4 rows it uses both


def on_cpu() -> bool:
    """Whether MLX runs on the CPU: a device fact (streams to release), not a kernel choice;
    the engines decide by their kernel set (engines/forward/kernels.py)."""
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
    if scores.dtype == mx.float32:  # in place: a long scoring chunk's scores held once
        probs = mx.array(_np_softmax(np.array(scores)))
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.reshape(b, kv, rep * length, s) @ values
    return out.reshape(b, h, length, d)


def numpy_silu() -> bool:
    """Whether a large SiLU goes through numpy (linux_cpu set): where MLX's kernels are not
    built for this CPU (native.jit)."""
    return not jit.active()


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x: one fused kernel, or the sigmoid in numpy for large float32 inputs where
    MLX's kernels are not built for this CPU."""
    if not numpy_silu():
        return silu_mul(gate, x)
    if gate.size < NUMPY_MIN_ELEMENTS or gate.dtype != mx.float32:
        return mx.sigmoid(gate) * gate * x
    g = np.array(gate)
    sig = np.exp(-g)
    sig += 1.0
    np.divide(g, sig, out=g)  # silu(g) = g / (1 + exp(-g))
    return mx.array(g) * x


def split_helps(rows: int) -> bool:
    """Whether a product of `rows` rows runs faster as two halves on two streams: only under
    the BLAS alone. The preloaded skinny library (llm_server.native.skinny) threads the
    products itself, at close to memory speed."""
    return rows <= SPLIT_MAX_ROWS and not skinny.loaded()


_local = threading.local()  # MLX streams belong to the thread that made them


def _side_streams() -> tuple:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = (mx.new_stream(mx.cpu),)
    return streams


def release_streams() -> None:
    """Finish and destroy this thread's split streams; call before the thread ends.

    MLX streams belong to the thread that made them, and when that thread ends with its streams
    alive the process can abort at exit ("terminate called without an active exception").
    """
    streams = getattr(_local, "streams", None)
    if streams is None and not on_cpu():
        return  # Metal: unchanged (never measured there)
    for stream in streams or ():
        mx.synchronize(stream)
    mx.synchronize()
    # also without split streams (the skinny products make none): a CPU thread that ended
    # without this aborted the process at exit ~1 run in 4
    mx.clear_streams()
    if streams is not None:
        del _local.streams


def split_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., in] @ weight[out, in].T with the output columns in two halves on two CPU streams.

    A decode step of one or two rows reads every weight once and is bandwidth-bound, but the BLAS
    runs such skinny products on one core; two streams put both cores' bandwidth to work. Each
    output is the same dot product as in the unsplit product. The first half runs on the
    forward's own stream, the second on a side stream: one thread hand-off per product instead
    of two, and two busy threads for two cores.
    """
    half = weight.shape[0] // 2
    return split_matmul_halves(x, (weight[:half].T, weight[half:].T))


def split_matmul_halves(x: mx.array, halves: tuple[mx.array, mx.array]) -> mx.array:
    """x @ concat(halves, axis=1), the halves [in, out/2] on two CPU streams (split_matmul)."""
    return mx.concatenate(split_matmuls(x, halves), axis=-1)


def split_matmuls(x: mx.array, halves: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
    """(x @ halves[0], x @ halves[1]): the first on the current stream, the second on this
    thread's side stream (see split_matmul)."""
    (side,) = _side_streams()
    return mx.matmul(x, halves[0]), mx.matmul(x, halves[1], stream=side)
