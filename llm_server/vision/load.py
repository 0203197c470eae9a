"""Which checkpoints get a vision renderer, and the words when one cannot."""

from __future__ import annotations

import json
from pathlib import Path

from llm_server.engines.mlx.vlm_checkpoint import TEXT_FAMILIES, is_vlm
from llm_server.tokenizer import Tokenizer
from llm_server.vision.renderer import VisionRenderer

INSTALL = "pip install 'llm-server[vision]'"
# VLM families whose language model mlx-lm runs as text only: image positions need M-RoPE's
# 3-D positions, which the engine's rows (one position per token) cannot give
POSITIONS_3D = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
SERVED = sorted({t.replace("-", "_") for t in TEXT_FAMILIES})  # families whose images are served


class VisionUnavailable(RuntimeError):
    """The model is a vision-language checkpoint whose images this server cannot take."""


def load_vision(path: Path, tokenizer: Tokenizer) -> VisionRenderer | None:
    """The renderer of a vision-language checkpoint at `path`; None for a text model;
    VisionUnavailable (with what to do) for a VLM whose images cannot be served. A folder
    without config.json (a Core ML model's, a GGUF conversion's tokenizer folder) is text."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        return None
    model_type = config.get("model_type")
    if model_type in POSITIONS_3D and "vision_config" in config:
        raise VisionUnavailable(
            f"images are not served for {model_type}: its language model gives image positions "
            "3-D rotary positions (M-RoPE), which this server's engine does not; text requests "
            "are served"
        )
    if "vision_config" not in config:
        return None  # a text model
    if not is_vlm(config):
        raise VisionUnavailable(
            f"images are not served for {model_type} (served: {', '.join(SERVED)}); text "
            "requests are served"
        )
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        raise VisionUnavailable(
            f"{Path(path).name} is a vision-language model ({model_type}) and images need "
            f"mlx-vlm: {INSTALL}"
        ) from None
    try:
        return VisionRenderer(Path(path), tokenizer)
    except Exception as exc:  # noqa: BLE001 - a tower that does not load leaves the text served
        raise VisionUnavailable(
            f"the vision tower or processor of {Path(path).name} ({model_type}) did not load "
            f"({type(exc).__name__}: {exc}); text requests are served"
        ) from exc
