"""mlx-lm's modules under the Linux-CPU kernel set, for models outside the fused forward:
numpy attention and SwiGLU patched into a model family's module for large tensors (`install`),
1-2 row products split over two CPU streams (`split_linears`, `lm_head`)."""

from __future__ import annotations

import sys

import mlx.core as mx

from llm_server.mlx_ops import PATCHED, use_mlx_lm_own
from llm_server.native.cpu_kernels import (
    NUMPY_MIN_ELEMENTS,
    attention,
    split_helps,
    split_matmul,
    swiglu,
)

_INSTALLED = PATCHED  # model module -> whether its patches are on (install)


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


def lm_head(layer, tied: bool, hidden: mx.array, split: bool) -> mx.array:
    """The output projection `layer` (`tied`: the embedding's `as_linear`); `split` (the
    linux_cpu set): across streams for a 1-2 row decode step."""
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
    (the linux_cpu kernel set), else through mlx-lm's own. The module is shared by every model
    of its family in the process: the engine loaded last decides (one set per process in
    practice: LLM_SERVER_KERNELS)."""
    module = sys.modules[type(model).__module__]
    if not numpy_large:
        use_mlx_lm_own(model)
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
