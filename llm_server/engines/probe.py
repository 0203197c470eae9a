"""Which engine serves a model folder, and whether it can batch (S1)."""

from __future__ import annotations

from pathlib import Path


def supports_batching(model_path: str | Path) -> bool:
    """True when the graph has an attn_mask input and a batch dimension above 1.

    Converter outputs say so in their manifest; a plain HF/MLX folder is run by the MLX engine,
    which feeds per-row masks and any batch size, so it supports batching.
    """
    try:
        from converters.manifest import supports_batching as from_manifest
    except ImportError:
        return True
    return from_manifest(model_path)
