"""Dequantize GGUF tensors with numpy: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (ggml block layouts)."""

from __future__ import annotations

from typing import Any

import numpy as np

_QK = 32  # elements per block in Q8_0 / Q4_0 / Q4_1


def _fp16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian fp16 at byte `start` of each block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n_blocks, 16] packed bytes -> [n_blocks, 32] uint8: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 bytes [..., n*34] -> float32 [..., n*32]; block = fp16 d, 32 x int8 q; x = q*d."""
    blocks = raw.reshape(-1, 2 + _QK)
    d = _fp16_column(blocks, 0)
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return (q * d).reshape(*raw.shape[:-1], -1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 bytes [..., n*18] -> float32 [..., n*32]; block = fp16 d, 16 nibble bytes; x = (q-8)*d."""
    blocks = raw.reshape(-1, 2 + _QK // 2)
    d = _fp16_column(blocks, 0)
    q = _nibbles(blocks[:, 2:]).astype(np.float32) - 8.0
    return (q * d).reshape(*raw.shape[:-1], -1)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 bytes [..., n*20] -> float32 [..., n*32]; block = fp16 d, fp16 m, 16 nibble bytes; x = q*d + m."""
    blocks = raw.reshape(-1, 4 + _QK // 2)
    d, m = _fp16_column(blocks, 0), _fp16_column(blocks, 2)
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return (q * d + m).reshape(*raw.shape[:-1], -1)


def _dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)


_DEQUANTIZERS = {
    "Q8_0": dequantize_q8_0,
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
    "BF16": _dequantize_bf16,
}


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUFReader tensor as float32 in numpy order (GGML `shape` reversed)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type.name
    if kind in ("F32", "F16"):
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    if kind not in _DEQUANTIZERS:
        raise ValueError(
            f"tensor {tensor.name!r} has type {kind}, which import_gguf does not support; "
            f"supported: F32, F16, {', '.join(_DEQUANTIZERS)}. Re-quantize the model with "
            "llama.cpp (`llama-quantize --allow-requantize ... Q8_0`) or convert from the HF checkpoint."
        )
    return _DEQUANTIZERS[kind](np.asarray(tensor.data)).reshape(shape)
