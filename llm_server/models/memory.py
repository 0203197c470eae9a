"""Memory sizes: what a model will hold once loaded (weights + KV rows + prefix cache), the
default budget, and the process's resident size."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from llm_server.engines.kv.prefix_cache import default_bound, kv_token_bytes
from llm_server.models.checkpoint import DTYPE_BYTES, read_header

DEFAULT_BUDGET_FRACTION = 0.75  # of physical memory, when --max-memory is not given
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_FLOATS = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class ModelSize:
    """Bytes a loaded model may hold; `total` is what the budget counts."""

    weights: int
    kv: int  # the serving rows' keys and values at the full context
    prefix_cache: int  # the prefix cache's bound

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache


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


def format_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def estimate_size(
    path: Path,
    rows: int,
    context_length: int | None,
    dtype: str = "float32",
    keep_quantized: bool = False,
    prefix_cache_bytes: int | None = None,
) -> ModelSize:
    """What the model at `path` holds once loaded with these settings (before loading it)."""
    if path.suffix == ".mlpackage" or any(path.glob("*.mlpackage")):
        files = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return ModelSize(files, 0, 0)
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)  # a VLM's language model
    width = _DTYPE_BYTES.get(dtype, 4)
    bits = (config.get("quantization") or {}).get("bits")
    weights = _weight_bytes(path, width, None if keep_quantized else bits)
    if prefix_cache_bytes is None:  # the engine's own default bound (engines/kv/prefix_cache.py)
        prefix_cache_bytes = default_bound(kv_token_bytes(config, width))
    return ModelSize(weights, _kv_bytes(config, rows, context_length, width), prefix_cache_bytes)


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


def _kv_bytes(config: dict, rows: int, context_length: int | None, width: int) -> int:
    layers = config.get("num_hidden_layers", 0)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    context = config.get("max_position_embeddings", 4096)
    if context_length is not None:
        context = min(context, context_length)
    return layers * 2 * kv_heads * head_dim * context * rows * width
