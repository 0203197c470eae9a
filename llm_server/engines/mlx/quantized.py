"""Quantized MLX checkpoints at load: dequantize to float32 on the CPU, keep them on Metal.

MLX's CPU backend has no fast quantized kernels (mlx_lm took 44 s for 4 x 16 tokens of 4-bit
SmolLM2 on 2 cores, where float32 runs ~20x faster), so on the CPU the quantized layers mlx-lm
built from the config's `quantization` (uniform or per-layer) become float layers at load, as the
GGUF import does, when float32 fits in memory. On Metal they stay quantized: the engine then runs
mlx-lm's own quantized forward (FusedForward.build returns None for quantized layers).
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

# Share of the memory available at load that the float32 weights may take.
FIT_FRACTION = 0.75


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every quantized layer (QuantizedLinear/Embedding, MoE switch layers)."""
    return [(name, m) for name, m in model.named_modules() if _is_quantized(m)]


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "bits") and hasattr(module, "group_size") and "scales" in module


def float32_bytes(modules: list[tuple[str, nn.Module]]) -> int:
    """Bytes the quantized layers' weights take as float32 (packed uint32 -> 32 / bits values)."""
    total = 0
    for _, m in modules:
        packed = m.weight  # [..., out, in * bits / 32] uint32
        total += packed.size * 32 // m.bits * 4
    return total


def available_memory() -> int | None:
    """Bytes of memory available now (Linux: MemAvailable, page cache included), else the
    physical memory (macOS: unified memory); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def describe(modules: list[tuple[str, nn.Module]]) -> str:
    """'4-bit affine, group 64' or, for a per-layer mix, '4/8-bit affine, groups 32/64'."""
    bits = sorted({m.bits for _, m in modules})
    groups = sorted({m.group_size for _, m in modules})
    modes = sorted({getattr(m, "mode", "affine") for _, m in modules})
    group_text = (
        f"group {groups[0]}" if len(groups) == 1 else f"groups {'/'.join(map(str, groups))}"
    )
    return f"{'/'.join(map(str, bits))}-bit {'/'.join(modes)}, {group_text}"


def prepare(model: nn.Module, keep_quantized: bool, dequantize: bool) -> bool:
    """Dequantize `model`'s quantized layers to float32 in place where that is the fast choice
    and `dequantize` (KernelSet.dequantize: MLX's CPU quantized products are slow).

    Returns whether quantized layers remain (then the engine runs mlx-lm's forward for them).
    Call it on the freshly (lazily) loaded model, before any other weight transformation.
    """
    from mlx_lm.utils import dequantize_model

    modules = quantized_modules(model)
    if not modules:
        return False
    kind = describe(modules)
    if keep_quantized or not dequantize:
        why = "--keep-quantized" if keep_quantized else "the generic kernel set: Metal's are fast"
        log.info("serving %d quantized layers (%s) quantized (%s)", len(modules), kind, why)
        return True
    need, have = float32_bytes(modules), available_memory()
    if have is not None and need > FIT_FRACTION * have:
        log.warning(
            "kept %d quantized layers (%s) quantized: float32 would take %.1f GB of the %.1f GB "
            "available; MLX's CPU quantized products are slow",
            len(modules),
            kind,
            need / 1e9,
            have / 1e9,
        )
        return True
    # float32 scales and biases first, so the dequantized weights are float32 products too
    model.set_dtype(mx.float32)
    dequantize_model(model)
    log.info(
        "dequantized %d quantized layers (%s) to float32 for the CPU (%.1f MB); "
        "--keep-quantized keeps them quantized",
        len(modules),
        kind,
        need / 1e6,
    )
    return False
