"""Export an HF checkpoint folder to an MLX folder mlx-lm loads, plus `llm_manifest.json`.

Weights are cast to the requested dtype and optionally quantized with mlx-lm's own affine
quantization (recorded in config.json under "quantization", which is how mlx-lm reloads it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from converters.manifest import (
    DEFAULT_Q_SIZES,
    TOKENIZER_FILES,
    ConvertError,
    Manifest,
    graph_inputs,
    read_hf_config,
    source_sha256,
    write_manifest,
)

DTYPES = ("float32", "float16", "bfloat16")
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZE = 64


def check_export_shape(rows: int, context_length: int, config: dict) -> None:
    """Reject shapes no graph can have (shared by both exporters)."""
    if rows < 1:
        raise ConvertError(f"--rows must be at least 1 (got {rows})")
    limit = config.get("max_position_embeddings")
    if context_length < 1 or (limit is not None and context_length > limit):
        raise ConvertError(f"--context must be in 1..{limit} for this model (got {context_length})")


def copy_tokenizer(src: Path, out: Path) -> None:
    """Copy the tokenizer and chat-template files the server needs beside the weights."""
    if not (src / "tokenizer.json").is_file():
        raise ConvertError(f"{src}: no tokenizer.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def export_mlx(
    src: str | Path,
    out_dir: str | Path,
    *,
    rows: int = 4,
    context_length: int | None = None,
    dtype: str = "float32",
    quantize: int | None = None,
    source_hash: str | None = None,
) -> Path:
    """Write an MLX folder for HF folder `src` into `out_dir` and return it.

    `rows`/`context_length` only describe the interface in the manifest: the MLX engine feeds
    masks of any batch size, so the folder itself is shape-free.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src, out = Path(src), Path(out_dir)
    config = read_hf_config(src)
    context_length = context_length or int(config.get("max_position_embeddings", 2048))
    check_export_shape(rows, context_length, config)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype})")
    if quantize is not None and quantize not in QUANT_BITS:
        raise ConvertError(f"--quantize must be 4 or 8 (got {quantize})")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ConvertError(f"{src}: no *.safetensors weights")

    model, config = load_model(src, lazy=True)
    model.set_dtype(getattr(mx, dtype))
    if quantize is not None:
        model, config = quantize_model(model, config, QUANT_GROUP_SIZE, quantize)
    config["torch_dtype"] = dtype
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    copy_tokenizer(src, out)
    manifest = Manifest(
        backend="mlx",
        model_type=config["model_type"],
        rows=rows,
        context_length=context_length,
        dtype=dtype,
        vocab_size=int(config["vocab_size"]),
        q_sizes=DEFAULT_Q_SIZES,
        inputs=graph_inputs(rows, context_length, dtype),
        source_sha256=source_hash or source_sha256(weights),
        quantization_bits=quantize,
    )
    write_manifest(out, manifest)
    return out
