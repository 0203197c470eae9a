"""What an mlx-lm model keeps per layer between forwards, and how the engine runs its head.

`cache_layout(model)` reads the caches mlx-lm itself would give the model (`make_cache()`, else
one KVCache per layer) and maps each onto what the engine keeps per row:
  - KVCache            -> keys/values in the row store (full attention);
  - RotatingKVCache    -> keys/values in the row store + a per-row window mask of the same size
                          (sliding-window layers: gemma3, gpt-oss, mistral-style layer_types);
  - ArraysCache        -> a per-row state slot (convolution / linear-attention layers);
  - CacheList          -> each of its caches as above (falcon_h1: mamba and attention in one
                          layer).
Anything else (a rotating cache that keeps sink tokens, llama4's chunked attention) cannot be
held per row yet: the engine then serves one request at a time through mlx-lm's own caches and
says why (`Layout.serial_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV, STATE, LIST = "kv", "state", "list"
# mlx-lm model modules whose Model.__call__ is exactly `lm_head(inner(...))` (or the tied
# embedding): the engine may apply its own (CPU-split) head to the last position
PLAIN_HEAD_MODULES = frozenset({"llama", "qwen2", "qwen3", "smollm3"})
_INNER_NAMES = ("model", "backbone", "transformer", "language_model")
# families whose attention scores carry a query-group axis, [B, kv_heads, groups, q, kv]: a
# per-row mask [B, 1, q, kv] must become [B, 1, 1, q, kv] to broadcast against them
GROUPED_SCORE_MODULES = frozenset({"gemma2"})


@dataclass(frozen=True)
class LayerCache:
    kind: str  # KV | STATE | LIST
    window: int | None = None  # KV: sliding window (None: full attention)
    size: int = 0  # STATE: arrays per slot
    parts: tuple[LayerCache, ...] = ()  # LIST: its caches


@dataclass(frozen=True)
class Layout:
    layers: tuple[LayerCache, ...]  # one per entry of the model's cache list
    serial_reason: str | None  # why rows cannot be kept per row (None: they can)

    @property
    def leaves(self) -> tuple[LayerCache, ...]:
        """KV and STATE entries in order, lists flattened: one store slot each."""
        return tuple(leaf for c in self.layers for leaf in (c.parts if c.kind == LIST else (c,)))

    @property
    def stateful(self) -> bool:
        return any(c.kind == STATE for c in self.leaves)

    @property
    def plain(self) -> bool:
        """Only full-attention KV layers (what the fused decoder handles)."""
        return all(c.kind == KV and c.window is None for c in self.layers)


def check_model_type(config: dict) -> None:
    """Any architecture mlx-lm has a model class for (a VLM's: its language model's); else a
    ValueError naming the type."""
    from mlx_lm.utils import _get_classes

    from llm_server.engines.mlx.vlm_checkpoint import is_vlm, text_config

    try:
        _get_classes(text_config(config) if is_vlm(config) else config)
    except (KeyError, ValueError):
        raise ValueError(
            f"model_type {config.get('model_type')!r} is not supported "
            "(mlx-lm has no model class for it)"
        ) from None


def make_cache(model) -> list:
    """The cache list mlx-lm gives `model` (models/cache.py make_prompt_cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _classify(cache, reasons: set[str]) -> LayerCache:
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    kind = type(cache)
    if kind is KVCache:
        return LayerCache(KV)
    if kind is RotatingKVCache and cache.keep == 0:
        return LayerCache(KV, window=int(cache.max_size))
    if isinstance(cache, ArraysCache):
        return LayerCache(STATE, size=len(cache.cache))
    if kind is CacheList:
        return LayerCache(LIST, parts=tuple(_classify(c, reasons) for c in cache.caches))
    detail = f" keeping {cache.keep} sink tokens" if kind is RotatingKVCache else ""
    reasons.add(f"{kind.__name__}{detail}")
    return LayerCache(KV)


def cache_layout(model) -> Layout:
    reasons: set[str] = set()
    layers = [_classify(cache, reasons) for cache in make_cache(model)]
    reason = None
    if reasons:
        reason = (
            f"its layers keep {', '.join(sorted(reasons))} caches, which the row cache "
            "cannot hold per request"
        )
    return Layout(tuple(layers), reason)


def kv_heads(model) -> list[tuple[int, int, int] | None] | None:
    """Per slot of the row store (`Layout.leaves`), (kv heads, k_dim, v_dim) of a layer with
    keys and values, None for a state: the shapes mlx-lm's own caches take from a one-token
    forward, built lazily and never evaluated. None when that forward cannot be built."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    caches = make_cache(model)
    try:
        model(mx.array([[0]]), cache=caches)
    except Exception:  # noqa: BLE001 - an unusual forward: the shapes are learnt at first write
        return None
    out: list[tuple[int, int, int] | None] = []

    def add(c) -> None:
        if isinstance(c, CacheList):
            for part in c.caches:
                add(part)
        elif isinstance(c, ArraysCache) or getattr(c, "keys", None) is None:
            out.append(None)
        else:
            out.append((int(c.keys.shape[1]), int(c.keys.shape[-1]), int(c.values.shape[-1])))

    for c in caches:
        add(c)
    return out


def row_views(layout: Layout, store, states, plan) -> list:
    """The engine's cache list for one forward: a view of the row store (`RowView`) or of the
    state slots (`RowStateView`) per entry of the model's cache list, a list of those for a
    CacheList."""
    from llm_server.engines.kv.state import RowStateView
    from llm_server.engines.kv.store import RowCacheList, RowView

    slot = iter(range(len(layout.leaves)))

    def view(c: LayerCache):
        if c.kind == LIST:
            return RowCacheList([view(p) for p in c.parts])
        i = next(slot)
        if c.kind == KV:
            return RowView(store, i, plan, c.window)
        return RowStateView(states, i, plan)

    return [view(c) for c in layout.layers]


def model_family(model) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def inner_name(model) -> str | None:
    """The attribute holding the decoder stack (None: not known; the head then sees every
    position)."""
    return next((name for name in _INNER_NAMES if name in model), None)


class _LastPosition:
    """The decoder stack, returning only the last position (attributes pass through)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __call__(self, *args, **kwargs) -> mx.array:
        return self._inner(*args, **kwargs)[:, -1:, :]

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _HeadProxy:
    """Stands in for the model inside its own `__call__`, so that mlx-lm's head (tied or scaled
    embeddings, logit soft-capping, logit scaling...) runs on the last position only."""

    def __init__(self, model, inner: str) -> None:
        self._model = model
        self._name = inner
        self._sliced = _LastPosition(model[inner])

    def __getattr__(self, name: str):
        return self._sliced if name == self._name else getattr(self._model, name)


def last_logits(model, inner: str | None, ids: mx.array, cache: list, **kw) -> mx.array:
    """mlx-lm's forward of `model` over ids [B, q]; logits [B, vocab] of the last position
    (`kw`: mlx-lm's `input_embeddings`)."""
    if inner is None:
        return model(ids, cache=cache, **kw)[:, -1, :]
    return type(model).__call__(_HeadProxy(model, inner), ids, cache=cache, **kw)[:, -1, :]


def output_head(model) -> tuple[object, bool]:
    """The model's output projection and whether it is tied to the input embeddings
    (`tie_word_embeddings`, or no `lm_head` at all: bare checkpoints), the one place that
    decides it. A tied head is the `nn.Embedding`, applied with `as_linear`."""
    tied = getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head")
    return (model.model.embed_tokens if tied else model.lm_head), tied
