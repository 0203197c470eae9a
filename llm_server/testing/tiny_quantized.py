"""Quantize a tiny checkpoint with mlx-lm, as `mlx_lm.convert -q` writes mlx-community models.

`mixed=True` writes a per-layer config (mlx-lm's `quantization` dict with one entry per layer):
v_proj, down_proj and lm_head at 8 bits with group 32, every other layer at `bits`/`group_size`,
the same shape of config as mlx-lm's mixed recipes (mixed_4_6 etc.).
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

HIGH_BITS = 8
HIGH_GROUP = 32
_HIGH = ("v_proj", "down_proj", "lm_head")


def _mixed(path: str, module) -> bool | dict:
    if any(part in path for part in _HIGH):
        return {"group_size": HIGH_GROUP, "bits": HIGH_BITS, "mode": "affine"}
    return True


def quantize_checkpoint(
    src: str | Path, out_dir: str | Path, bits: int = 4, group_size: int = 64, mixed: bool = False
) -> Path:
    """Write an affine-quantized copy of the HF/MLX folder `src` into `out_dir`; returns it."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src, out = Path(src), Path(out_dir)
    model, config = load_model(src, lazy=True)
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints the bits per weight
        model, config = quantize_model(
            model, config, group_size, bits, quant_predicate=_mixed if mixed else None
        )
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    return out
