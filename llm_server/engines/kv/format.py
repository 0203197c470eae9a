"""The KV format: how the store holds keys and values (`--kv-dtype`, `--kv-bits`).

Plain formats hold each value in a float dtype (float32, float16, bfloat16); quantized ones
(8 or 4 bits) hold each head's vector as mlx-lm's `QuantizedKVCache` does, `mx.quantize` with
a group size along the head dimension, its packed words, scales and biases side by side in one
uint32 array [..., width] (scales and biases as float32 bits). One array per layer keeps every
part of the engine that moves KV (row copies, growth, the prefix cache's slices and joins, the
disk tier) unchanged: only the store's write (`encode`) and read (`decode`) know the format.
Attention then runs on the decoded values in the compute dtype, every kernel set's own path,
so a row's arithmetic within a format does not depend on batching (S10).

A head dimension that is not a multiple of the group size is padded with zeros to one per
head (mlx-lm refuses such a head; tiny test models have 16-value heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV_DTYPES = ("float32", "float16", "bfloat16")
KV_BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes
DEFAULT_GROUP = 64
_MX = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_WORD = 32  # bits of the packed words (uint32)


@dataclass(frozen=True)
class KVFormat:
    """The store's format for a model computing in `compute` (a dtype name)."""

    compute: str  # the model's compute dtype: what `decode` returns
    dtype: str  # a plain format's storage dtype (a quantized one's scales are float32)
    bits: int | None = None  # 8 or 4: quantized; None: plain
    group_size: int = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES or self.compute not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        if self.bits is not None and self.bits not in KV_BITS:
            raise ValueError(f"kv bits must be one of {KV_BITS}, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv group size must be one of {GROUP_SIZES}, got {self.group_size}")

    @classmethod
    def of(
        cls, compute: str, dtype: str | None, bits: int | None, group_size: int | None
    ) -> KVFormat:
        """The format asked for (`dtype` None: the compute dtype)."""
        group = DEFAULT_GROUP if group_size is None else group_size
        if bits is not None:
            return cls(compute, "float32", bits, group)
        return cls(compute, dtype or compute, None, group)

    @property
    def identity(self) -> bool:
        """Values held exactly as computed: the store's arrays are the compute dtype's (what
        the Linux-CPU set's native decode ops and every fast path read directly)."""
        return self.bits is None and self.dtype == self.compute

    @property
    def name(self) -> str:
        """'float16', 'int8/g64'...; the disk tier's fingerprint and file header carry it."""
        return f"int{self.bits}/g{self.group_size}" if self.bits else self.dtype

    @property
    def storage(self) -> mx.Dtype:
        return mx.uint32 if self.bits else _MX[self.dtype]

    def _padded(self, dim: int) -> int:
        return -(-dim // self.group_size) * self.group_size

    def width(self, dim: int) -> int:
        """Stored values per head vector of `dim` values (the store's last axis)."""
        if not self.bits:
            return dim
        padded = self._padded(dim)
        return padded * self.bits // _WORD + 2 * (padded // self.group_size)

    def dim_of(self, width: int) -> int:
        """The head dimension a stored width holds (a padded head: its padded dimension)."""
        if not self.bits:
            return width
        return width * _WORD // (self.bits + 2 * _WORD // self.group_size)

    def bytes_per_vector(self, dim: int) -> int:
        """Bytes one head's keys (or values) of `dim` values take at one position."""
        return self.width(dim) * self.storage.size

    def config_token_bytes(self, config: dict) -> int:
        """KV bytes a position takes in every layer, from a config.json (as
        prefix_cache.kv_token_bytes, counted per head vector: a quantized one's scales)."""
        heads = int(config.get("num_attention_heads") or 1)
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
        return int(config.get("num_hidden_layers") or 0) * 2 * kv * self.bytes_per_vector(head_dim)

    def encode(self, x: mx.array) -> mx.array:
        """x [..., dim] in the compute dtype -> stored [..., width(dim)]."""
        if not self.bits:
            return x.astype(self.storage)
        dim = x.shape[-1]
        x = x.astype(mx.float32)
        if self._padded(dim) != dim:
            pad = [(0, 0)] * (x.ndim - 1) + [(0, self._padded(dim) - dim)]
            x = mx.pad(x, pad)
        words, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return mx.concatenate([words, mx.view(scales, mx.uint32), mx.view(biases, mx.uint32)], -1)

    def decode(self, stored: mx.array, dim: int) -> mx.array:
        """stored [..., width(dim)] -> values [..., dim] in the compute dtype (zeros: zeros)."""
        if not self.bits:
            return stored.astype(_MX[self.compute])
        padded = self._padded(dim)
        n, groups = padded * self.bits // _WORD, padded // self.group_size
        words = stored[..., :n]
        scales = mx.view(stored[..., n : n + groups], mx.float32)
        biases = mx.view(stored[..., n + groups :], mx.float32)
        out = mx.dequantize(words, scales, biases, group_size=self.group_size, bits=self.bits)
        if padded != dim:
            out = out[..., :dim]
        return out.astype(_MX[self.compute])


def bytes_per_element(
    compute_bytes: int, dtype: str | None, bits: int | None, group_size: int | None
) -> float:
    """Bytes a key or value element takes in the KV format (memory estimates: the group's
    float32 scale and bias spread over its values); `dtype` None: the compute dtype's."""
    if bits is not None:
        group = DEFAULT_GROUP if group_size is None else group_size
        return bits / 8 + 8 / group
    return compute_bytes if dtype is None else _MX[dtype].size
