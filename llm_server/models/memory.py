"""Memory sizes: what a model will hold once loaded (weights + KV rows + prefix cache), the
default budget, and the process's resident size."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from llm_server.engines.kv.budget import format_bytes as format_bytes  # re-exported
from llm_server.engines.kv.format import bytes_per_element
from llm_server.engines.kv.prefix_cache import default_bound, kv_token_bytes
from llm_server.engines.settings import SCORE_ROWS
from llm_server.models.checkpoint import DTYPE_BYTES, read_header

DEFAULT_BUDGET_FRACTION = 0.75  # of physical memory, when --max-memory is not given
SERIAL_STEP = 256  # positions mlx-lm's KVCache grows by (a serial model's caches)
FLOOR_POSITIONS = 2048  # a loaded model's first row can always reach this many positions
CONTEXT_STEP = 256  # a default context cut to fit the budget is a multiple of this
# mlx-lm families whose forward evaluates arrays (`.tolist()` in an MoE router, `mx.eval`):
# a lazy forward would allocate their weights, so they are counted from config.json instead
EVALUATING_FAMILIES = frozenset({"dbrx", "muse_spark"})
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_FLOATS = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class ModelSize:
    """Bytes a model holds once loaded: `needed` is what a load must find room for (the
    weights and one row's first positions); `total` is the most it could hold (every row at
    the full context, the prefix cache at its bound), which the budget never reserves: KV and
    prefix-cache growth ask it as they happen (engines/kv/budget.py)."""

    weights: int
    kv: int  # the serving and scoring rows' keys and values at `context`
    prefix_cache: int  # the prefix cache's bound
    context: int = 0  # positions per row: the model's own, or what a row can hold in the budget
    floor: int = 0  # one row's KV at min(context, FLOOR_POSITIONS): reserved while loaded

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache

    @property
    def needed(self) -> int:
        return self.weights + self.floor


def physical_memory() -> int:
    """Bytes of RAM in the machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget() -> int:
    return int(physical_memory() * DEFAULT_BUDGET_FRACTION)


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def estimate_size(
    path: Path,
    rows: int,
    context_length: int | None,
    dtype: str | None = "float32",
    keep_quantized: bool = False,
    prefix_cache_bytes: int | None = None,
    score_rows: int = SCORE_ROWS,
    budget: int | None = None,
    on_cpu: bool | None = None,
    kv_format: tuple[str | None, int | None, int | None] = (None, None, None),
) -> ModelSize:
    """What the model at `path` holds once loaded with these settings (before loading it):
    `dtype` None is the engine's default (engines/mlx/dtypes.py: on Metal the checkpoint's own
    half dtype); `score_rows`: the engine's scoring rows (none on a model served serially);
    `budget`: with `context_length` unset, the context is what `rows` rows can hold in the
    budget beside the weights (at most the model's own); `on_cpu`: size it as the CPU serves it
    (quantized layers dequantized unless `keep_quantized`) or as Metal does (the checkpoint's
    dtype, quantized layers kept); None: as this machine does.
    `kv_format`: the KV store's (kv_dtype, kv_bits, kv_group_size) as EngineSettings has them
    (None, None, None: the compute dtype). Recurrent states count in the compute dtype."""
    if path.suffix == ".mlpackage" or any(path.glob("*.mlpackage")):
        files = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return ModelSize(files, 0, 0)
    full = json.loads((path / "config.json").read_text())
    config = full.get("text_config", full)  # a VLM's language model
    if on_cpu is None:
        import mlx.core as mx

        on_cpu = mx.default_device() == mx.cpu
    if dtype is None:
        from llm_server.engines.mlx.dtypes import default_dtype

        dtype = default_dtype(path, on_cpu)
    width = _DTYPE_BYTES.get(dtype, 4)
    bits = (config.get("quantization") or {}).get("bits")
    # the CPU kernel set dequantizes (quantized.prepare); Metal serves quantized layers as is
    dequantize = on_cpu and not keep_quantized
    weights = _weight_bytes(path, width, bits if dequantize else None)
    kv_width = bytes_per_element(width, *kv_format)  # bytes a key or value element takes
    if prefix_cache_bytes is None:  # the engine's own default bound (engines/kv/prefix_cache.py)
        prefix_cache_bytes = default_bound(int(kv_token_bytes(config, kv_width)))
    max_pos = int(config.get("max_position_embeddings") or 2048)  # as the engine reads it
    held = row_bytes(full, width, kv_width)
    if held is None:  # mlx-lm cannot build it: every layer counted as full attention
        held = RowBytes(int(kv_token_bytes(config, kv_width)), 0, scoring=True, serial=False)
    if held.serial:
        rows = 1
    if context_length is not None:
        context = min(context_length, max_pos)
    else:
        context = budget_context(held, rows, max_pos, None if budget is None else budget - weights)
    if held.serial:  # one request at a time in mlx-lm's caches, grown 256 positions at a time
        context = -(-context // SERIAL_STEP) * SERIAL_STEP
    if not held.scoring:
        score_rows = 0
    kv = (held.position * context + held.state) * (rows + score_rows)
    floor = held.position * min(context, FLOOR_POSITIONS) + held.state
    return ModelSize(weights, kv, prefix_cache_bytes, context, floor)


def budget_context(held: RowBytes, rows: int, max_pos: int, room: int | None) -> int:
    """The default context: the model's own `max_pos`, cut to what `rows` rows hold in `room`
    bytes (a multiple of CONTEXT_STEP, at least one step; None: no budget)."""
    if room is None or held.position == 0:
        return max_pos
    fits = (room // rows - held.state) // held.position
    return max(min(max_pos, fits // CONTEXT_STEP * CONTEXT_STEP), min(CONTEXT_STEP, max_pos))


@dataclass(frozen=True)
class RowBytes:
    """What one row of the engine's store holds, by what the architecture keeps per layer."""

    position: int  # keys and values of one position over the layers that keep them
    state: int  # the recurrent layers' constant state
    scoring: bool  # the engine keeps scoring rows (a plain head or recurrent state, not
    # served serially: engine._compose)
    serial: bool  # caches the row store cannot hold: served one at a time (layout.py)


def row_bytes(config: dict, width: int, kv_width: float | None = None) -> RowBytes | None:
    """One row's bytes for the model `config` describes, `width` bytes a value (`kv_width` a
    key or value element: the KV format's, kv/format.py; None: `width`), read from the
    caches mlx-lm gives it after a one-token forward built lazily (shapes only: no weight is
    allocated, nothing computed): KV-shared layers have no cache of their own, recurrent
    layers an `ArraysCache` of constant size. Sliding-window layers count every position:
    the row store keeps them all (engines/kv/store.py). None when mlx-lm cannot build it."""
    try:
        import mlx.core as mx

        from llm_server.engines.mlx.bare_checkpoint import model_classes
        from llm_server.engines.mlx.layout import (
            PLAIN_HEAD_MODULES,
            cache_layout,
            make_cache,
            model_family,
        )

        model_cls, args_cls = model_classes(config)
        model = model_cls(args_cls.from_dict(config))
        if model_family(model) in EVALUATING_FAMILIES:
            return None
        caches = make_cache(model)
        model(mx.array([[0]]), cache=caches)  # a graph, never evaluated
        position, state = _cache_bytes(caches, width, width if kv_width is None else kv_width)
        layout = cache_layout(model)
    except Exception:  # noqa: BLE001 - an architecture this cannot read: the config's count
        return None
    serial = layout.serial_reason is not None
    # as engine._compose: logits at every position from a plain head, or a hybrid's own head
    scoring = not serial and (model_family(model) in PLAIN_HEAD_MODULES or state > 0)
    return RowBytes(position, state, scoring=scoring, serial=serial)


def _cache_bytes(caches: list, width: int, kv_width: float) -> tuple[int, int]:
    """(bytes a position takes, constant state bytes) in mlx-lm's `caches` for one row (keys
    and values at `kv_width` bytes an element, states at `width`)."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    position = state = 0
    for cache in caches:
        if isinstance(cache, CacheList):
            more, fixed = _cache_bytes(list(cache.caches), width, kv_width)
            position, state = position + more, state + fixed
        elif isinstance(cache, ArraysCache):
            state += sum(a.size for a in cache.cache if a is not None) * width
        else:  # keys and values [1, kv_heads, positions, head_dim]
            keys, values = cache.keys, cache.values
            elements = keys.size // keys.shape[2] + values.size // values.shape[2]
            position += int(elements * kv_width)
    return position, state


def _weight_bytes(path: Path, width: int, dequantize_bits: int | None) -> int:
    """Weights in the serving dtype (`width` bytes per float); packed ints dequantized when
    `dequantize_bits` is set, else kept as stored."""
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        for name, info in read_header(shard).items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            stored = info["dtype"]
            if stored in _FLOATS:
                total += numel * width
            elif stored == "U32" and dequantize_bits:
                total += numel * (32 // dequantize_bits) * width
            else:
                total += numel * DTYPE_BYTES[stored]
    return total
