"""What an MLX engine is asked for at load: one frozen settings object, its defaults and checks.

`MLXEngine(model_path, settings)` reads nothing else; what depends on the model (the dtype a
checkpoint defaults to, rows a model cannot batch, the context it supports) is decided there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_server.engines.kv.format import GROUP_SIZES, KV_BITS, KV_DTYPES

DTYPES = ("float32", "float16", "bfloat16")
PARALLEL = ("tensor", "pipeline")
SCORE_ROWS = 8  # scoring rows of the store: scoring prompts open at once (see score_rows)
# seconds an idle engine keeps its KV store and the released rows' histories in it (mlx_rows):
# an agent's next turn, after its tool ran or its user read the answer, reuses its prefix in
# place; then the memory goes back
KV_KEEP_ALIVE_S = 60.0


@dataclass(frozen=True)
class EngineSettings:
    """How to load and run one MLX engine; every field has the default a plain load gets."""

    rows: int = 1  # serving rows (1 where the model cannot batch: the scheduler warns, S1)
    context_length: int | None = None  # positions per row (None: the model's own maximum)
    dtype: str | None = None  # None: float32 on the CPU, the checkpoint's own on Metal (dtypes)
    # bound of the prompt prefix cache in bytes (None: prefix_cache.default_bound, two
    # 20k-token conversations' KV within an eighth of the memory; 0: off)
    prefix_cache_bytes: int | None = None
    # have the scorer pad scoring shapes to buckets (C4). MLX runs any shape without a
    # compile, so by default it gets exact shapes and computes no padding
    padded_shapes: bool = False
    fused_decode: bool = True  # run steps through `FusedForward` where the architecture allows
    # let the scheduler start a greedy step before the one before is finished (None: the
    # kernel set's choice, on Metal only: on the CPU the Python work competes with the forward)
    pipeline: bool | None = None
    keep_quantized: bool = False  # serve a quantized checkpoint quantized on the CPU too
    # run pure decode steps as compiled graphs (compiled_step; None: the kernel set's choice,
    # on the CPU, where their logits equal the eager forward's bit for bit)
    compiled_decode: bool | None = None
    # an `mx.distributed` group to shard the model over; every rank then runs the same calls
    # in lock-step (llm_server.distributed). The fused forward, pipelining and scoring rows
    # are off: they do not compose with it
    group: Any = None
    # "tensor" (mlx-lm's `model.shard`) or "pipeline": this rank keeps a contiguous slice of
    # the layers and their KV (llm_server.engines.mlx.pipeline)
    parallel: str = "tensor"
    # rows the store keeps after the serving rows for scoring prompts, whose chunks then ride
    # in the step plans' forwards; 0, and always on a model whose rows cannot hold them
    # (recurrent state, serial, sharded, heads only mlx-lm can run): the separate session
    score_rows: int = SCORE_ROWS
    # "linux_cpu" or "generic" (engines/forward/kernels.py; None: LLM_SERVER_KERNELS, else linux_cpu
    # on the CPU and generic elsewhere), chosen once at load for every forward
    kernels: str | None = None
    # seconds an idle engine keeps its KV store, the released rows' histories in place (a
    # conversation's next turn reuses its prefix there with no copy); 0: given back at once
    kv_keep_alive: float = KV_KEEP_ALIVE_S
    # the prefix cache's disk tier (--prefix-cache-dir; None: memory only), read back into the
    # rows at load, and its bound in bytes (None: prefix_disk.default_disk_bytes)
    prefix_cache_dir: Path | None = None
    prefix_cache_disk_bytes: int | None = None
    # prompts (token ids) prefilled at load and released: the first request that opens with
    # one is a prefix cache hit (--warm-prompts, tokenized by the service)
    warm_tokens: tuple[tuple[int, ...], ...] = ()
    # the memory budget's account this engine draws on (engines/kv/budget.py `Account`: every
    # KV growth and prefix-cache entry asks it first; None: no budget)
    budget: Any = None
    # the KV store's format (engines/kv/format.py). kv_dtype: float32, float16 or bfloat16
    # (None: the compute dtype on the CPU, float32 there; on Metal the checkpoint's half
    # dtype); kv_bits: 8 or 4, quantized as mlx-lm's QuantizedKVCache in groups of
    # kv_group_size values (None: 64), exclusive with kv_dtype. Recurrent layers' states stay
    # in the compute dtype
    kv_dtype: str | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.parallel not in PARALLEL:
            raise ValueError(
                f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}"
            )
        if self.score_rows < 0:
            raise ValueError(f"score_rows must be >= 0, got {self.score_rows}")
        if not self.kv_keep_alive >= 0:  # (NaN too)
            raise ValueError(f"kv_keep_alive must be >= 0 seconds, got {self.kv_keep_alive}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS}, got {self.kv_bits}")
        if self.kv_bits is not None and self.kv_dtype is not None:
            raise ValueError("kv_bits and kv_dtype are exclusive: quantized KV has no float dtype")
        group = self.kv_group_size
        if group is not None and group not in GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {GROUP_SIZES}, got {group}")
        if group is not None and self.kv_bits is None:
            raise ValueError("kv_group_size applies to quantized KV only (kv_bits)")
        disk = self.prefix_cache_disk_bytes
        if disk is not None and disk < 0:
            raise ValueError(f"prefix_cache_disk_bytes must be >= 0, got {disk}")

    @property
    def sharded(self) -> bool:
        """Whether the model is split over more than one rank."""
        return self.group is not None and self.group.size() > 1
