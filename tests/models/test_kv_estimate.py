"""The size estimate counts keys and values in the KV format (--kv-dtype, --kv-bits) and
recurrent states in the compute dtype: what the engine holds at full context."""

from __future__ import annotations

import pytest

from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.models.memory import estimate_size
from llm_server.testing.families import build_family_checkpoint

CONTEXT = 64


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_the_estimate_counts_the_kv_format(tmp_path, family):
    path = build_family_checkpoint(tmp_path / family, family)
    plain = estimate_size(path, 1, CONTEXT, "float32", score_rows=0).kv
    half = estimate_size(
        path, 1, CONTEXT, "float32", score_rows=0, kv_format=("float16", None, None)
    )
    engine = MLXEngine(path, EngineSettings(rows=1, context_length=CONTEXT, kv_dtype="float16"))
    engine.prefill(0, [5 + i % 50 for i in range(CONTEXT)])  # one row at the full context
    assert half.kv == engine.kv_bytes() < plain
    # 8 bits and a float32 scale and bias per 64 values: 1.125 bytes a value
    q8 = estimate_size(path, 1, CONTEXT, "float32", score_rows=0, kv_format=(None, 8, None)).kv
    state = 2 * half.kv - plain  # (the states, in the compute dtype either way)
    assert q8 - state == pytest.approx((plain - state) * 1.125 / 4, abs=8)
