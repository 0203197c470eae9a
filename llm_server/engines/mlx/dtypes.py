"""The compute dtype when `--dtype` is not given: float32 on the CPU, the checkpoint's own on Metal.

On the CPU, float32 is the fast path (the BLAS, the skinny products and the decode ops are
float32 kernels; bf16/fp16 matmuls there are emulated and slower) and the one the exactness
promises are measured in. On Metal, float32 doubles a bf16 checkpoint's memory (an 8B model
~32 GB instead of ~16 GB) and halves its decode speed (decoding reads every weight once a step),
so the checkpoint's own float16/bfloat16 is the default there; `--dtype float32` still asks for
float32 (its products then run in full precision: blas.exact_float32).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HALF = {"bfloat16": "bfloat16", "float16": "float16", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(path: Path) -> str | None:
    """'bfloat16' or 'float16' when the checkpoint at `path` stores its weights so, else None.

    Read from config.json (`torch_dtype`, or `dtype` in newer transformers, also in a VLM's
    `text_config`), else from the first safetensors header's first floating-point tensor.
    """
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for section in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if isinstance(section.get(key), str):
                return HALF.get(section[key])
    for file in sorted(path.glob("*.safetensors"))[:1]:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype", "").startswith(("F", "BF")):
                return HALF.get(info["dtype"])
    return None


def default_dtype(path: Path, on_cpu: bool | None = None) -> str:
    """float32 on the CPU; on a GPU (Metal) the checkpoint's half dtype, else float32."""
    if on_cpu is None:
        import mlx.core as mx

        on_cpu = mx.default_device() == mx.cpu
    if on_cpu or not path.is_dir():
        return "float32"
    return checkpoint_dtype(path) or "float32"
