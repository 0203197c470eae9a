"""GGUF Q4_1 -> llm-convert --to mlx -> the MLX engine, against the dequantized reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.cli import main as convert_main
from converters.gguf_import import import_gguf
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint
from tests.converters.test_gguf_import import write_gguf

PROMPT = [5, 17, 42, 99, 3, 250, 7, 1, 120, 64, 33, 8]


def _greedy_logits(folder: Path, steps: int = 6) -> list[np.ndarray]:
    engine = MLXEngine(folder, EngineSettings(rows=1, prefix_cache_bytes=0))
    logits = [engine.prefill(0, PROMPT)]
    for _ in range(steps):
        logits.append(engine.decode([0], [int(np.argmax(logits[-1]))])[0])
    return logits


def test_q4_1_gguf_exports_to_mlx_and_serves_like_its_dequantized_weights(tmp_path):
    tiny = build_tiny_checkpoint(tmp_path / "ckpt", TinySpec(arch="llama"))
    gguf = write_gguf(tiny, tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    assert convert_main(
        [str(gguf), "--to", "mlx", "--out", str(tmp_path / "mlx"), "--rows", "4"]
    ) in (0, None)
    exported = next(p.parent for p in (tmp_path / "mlx").rglob("config.json"))
    reference = import_gguf(gguf, tmp_path / "dequantized")  # Q4_1 blocks -> float32, un-permuted

    got, want = _greedy_logits(exported), _greedy_logits(reference)
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() <= 1e-5  # the export adds no error of its own
    # and the quantization error against the original float weights stays within Q4_1 noise
    original = _greedy_logits(tiny, steps=0)[0]
    spread = float(original.max() - original.min())
    assert np.abs(got[0] - original).max() <= 0.25 * spread
