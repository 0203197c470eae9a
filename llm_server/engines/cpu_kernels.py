"""CPU fast paths for the transcendental parts of a forward (softmax, SwiGLU, log-softmax).

MLX's prebuilt CPU ops evaluate exp/sigmoid one element at a time (~11 ns per element here),
while numpy's SIMD exp takes ~0.5 ns. For a 500-token prefill that made attention's softmax
and the MLP's SiLU half of the time. For large tensors these helpers evaluate the input, do
the transcendental part in numpy and hand the result back to the MLX graph (a sync and two
~0.1 ms copies); small tensors (a decode step at short context) stay in MLX, where a sync
would cost more. SwiGLU stays in MLX at any size where MLX builds its fused kernels for this
CPU (native.jit: exp and sigmoid in 16-float vectors, SiLU·up over [128, 1536] in 161 us
against numpy's ~290 and no sync). The softmax keeps numpy's in-place form: a long scoring
chunk's scores are held once, where MLX's graph holds them two or three times (the same speed
on the serving load). `install()` points mlx-lm's model module at them under the linux_cpu
kernel set (engines/kernels.py); the engine chooses the set and calls these only under it.
"""

from __future__ import annotations

import sys
import threading
from functools import partial

import mlx.core as mx
import numpy as np

from llm_server.engines import score_reduce
from llm_server.engines.layout import output_head
from llm_server.native import jit, skinny

NUMPY_MIN_ELEMENTS = 32_768  # below this an MLX op beats a round trip through numpy
_INSTALLED: dict[str, bool] = {}  # model module -> whether its patches are on (install)


def on_cpu() -> bool:
    """Whether MLX runs on the CPU: a device fact (streams to release), not a kernel choice;
    the engines decide by their kernel set (engines/kernels.py)."""
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


@partial(mx.compile, shapeless=True)
def silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x as one fused kernel (the decode positions' SiLU, and every position's
    where `numpy_silu()` is False)."""
    return gate * mx.sigmoid(gate) * x


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


def log_softmax(logits: mx.array) -> np.ndarray:
    """log-softmax over the last axis as a float32 numpy array (scoring reductions)."""
    return score_reduce.log_softmax(np.array(logits.astype(mx.float32)))


SPLIT_MAX_ROWS = 2  # BLIS runs a 1-2 row product on one core; from 4 rows it uses both


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
    output is the same dot product as in the unsplit product.

    The first half runs on the forward's own stream, the second on a side stream: one thread
    hand-off per product instead of two, and two busy threads for two cores. Measured on a
    SmolLM2 decode step (compiled, 24 alternating runs on the shared 2-core machine): median
    54.6 -> 40.9 ms against two side streams; a 20-token prefill was unchanged (95 ms).
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


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


def _split_linear_class():
    import mlx.nn as nn

    class SplitLinear(nn.Linear):
        """An nn.Linear (same parameters) whose 1-2 row products are split across two streams."""

        @classmethod
        def wrap(cls, linear: nn.Linear) -> SplitLinear:
            obj = cls.__new__(cls)
            nn.Module.__init__(obj)
            obj.weight = linear.weight
            if "bias" in linear:
                obj.bias = linear.bias
            return obj

        def __call__(self, x: mx.array) -> mx.array:
            if not split_helps(_rows(x)) or self.weight.dtype != mx.float32:
                return super().__call__(x)
            out = split_matmul(x, self.weight)
            return out + self.bias if "bias" in self else out

    return SplitLinear


def lm_head(model, hidden: mx.array, split: bool) -> mx.array:
    """The output projection; `split` (the linux_cpu set): across streams for a 1-2 row
    decode step."""
    layer, tied = output_head(model)
    weight = getattr(layer, "weight", None)
    plain = not split_helps(_rows(hidden)) or weight is None or weight.dtype != mx.float32
    if plain or not split or (not tied and "bias" in layer):
        return layer.as_linear(hidden) if tied else layer(hidden)
    return split_matmul(hidden, weight)


def split_linears(model) -> int:
    """Swap the decoder layers' float nn.Linear modules for SplitLinear (linux_cpu set)."""
    import mlx.nn as nn

    split_linear = _split_linear_class()
    count = 0
    for layer in model.model.layers:
        for part in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            for name, child in list(part.children().items()) if part is not None else []:
                if type(child) is nn.Linear:
                    part[name] = split_linear.wrap(child)
                    count += 1
    return count


def install(model, numpy_large: bool) -> bool:
    """Route the model module's attention and SwiGLU through these helpers when `numpy_large`
    (the engine's KernelSet.numpy_large), else through mlx-lm's own. The module is shared by every model
    of its family in the process: the engine loaded last decides (one set per process in
    practice: LLM_SERVER_KERNELS)."""
    module = sys.modules[type(model).__module__]
    if not numpy_large:
        if module.__name__ in _INSTALLED:
            _INSTALLED[module.__name__] = False
        return False
    if module.__name__ in _INSTALLED:
        _INSTALLED[module.__name__] = True
        return True
    name = module.__name__
    original_sdpa = getattr(module, "scaled_dot_product_attention", None)
    if original_sdpa is not None:

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            b, h, length, _ = queries.shape
            big = b * h * length * keys.shape[2] >= NUMPY_MIN_ELEMENTS
            if not big or sinks is not None or hasattr(cache, "bits") or not _INSTALLED[name]:
                return original_sdpa(
                    queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
                )
            return attention(queries, keys, values, scale, mask)

        module.scaled_dot_product_attention = sdpa
    original_swiglu = getattr(module, "swiglu", None)
    if original_swiglu is not None:
        module.swiglu = lambda gate, x: (swiglu if _INSTALLED[name] else original_swiglu)(gate, x)
    _INSTALLED[name] = True
    return True
