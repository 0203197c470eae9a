"""The size estimate counts what the architecture holds: only layers that keep keys and values,
recurrent layers their constant state, the scoring rows where the engine keeps them, and the
checkpoint's own dtype where the engine loads it (--dtype unset on Metal). Each family's
estimate equals the KV the engine holds once a row reaches the full context."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llm_server.engines.kv.prefix_cache import kv_token_bytes
from llm_server.engines.mlx import dtypes
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.models.memory import estimate_size, row_bytes
from llm_server.testing.families import build_family_checkpoint

CONTEXT = 64
# plain attention, sliding-window layers (the store keeps every position), convolution and
# attention, gated-delta and attention, chunked attention (served serially in mlx-lm's caches)
FAMILIES = ("llama", "gemma3_text", "lfm2", "qwen3_next", "llama4")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family_checkpoint(root / name, name) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_estimate_is_what_a_row_holds_at_full_context(family_models, family):
    path = family_models[family]
    engine = MLXEngine(path, EngineSettings(rows=1, context_length=CONTEXT))
    engine.prefill(0, [5 + i % 50 for i in range(CONTEXT)])  # one row at the full context
    size = estimate_size(path, 1, CONTEXT, "float32", score_rows=0)
    assert size.kv == engine.kv_bytes()


def test_recurrent_layers_count_their_state_not_keys_and_values(family_models):
    for family in ("lfm2", "qwen3_next"):
        config = json.loads((family_models[family] / "config.json").read_text())
        every_layer = kv_token_bytes(config, 4) * 1024  # what was counted before
        longer = estimate_size(family_models[family], 1, 1024, "float32", score_rows=0).kv
        assert longer < every_layer
        shorter = estimate_size(family_models[family], 1, 512, "float32", score_rows=0).kv
        state = 2 * shorter - longer  # kv = position bytes x context + constant state
        assert state > 0 and (longer - shorter) * 2 < every_layer


def test_scoring_rows_are_counted_where_the_engine_keeps_them(family_models):
    for family, scoring in (("llama", True), ("qwen3_next", True), ("gemma3_text", False)):
        path = family_models[family]
        engine = MLXEngine(path, EngineSettings(rows=1, context_length=CONTEXT))
        assert (engine.score_rows > 0) is scoring
        alone = estimate_size(path, 1, CONTEXT, "float32", score_rows=0).kv
        counted = estimate_size(path, 1, CONTEXT, "float32", score_rows=8).kv
        assert counted == alone * (1 + engine.score_rows)


def test_unset_dtype_counts_the_checkpoints_own_on_metal(family_models, tmp_path, monkeypatch):
    path = shutil.copytree(family_models["llama"], tmp_path / "bf16")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    on_cpu = estimate_size(path, 1, CONTEXT, None)
    assert on_cpu == estimate_size(path, 1, CONTEXT, "float32")  # the CPU computes in float32
    real = dtypes.default_dtype
    monkeypatch.setattr(dtypes, "default_dtype", lambda p, on_cpu=None: real(p, on_cpu=False))
    on_metal = estimate_size(path, 1, CONTEXT, None)
    assert on_metal == estimate_size(path, 1, CONTEXT, "bfloat16")
    assert on_metal.kv * 2 == on_cpu.kv and on_metal.weights * 2 == on_cpu.weights


def test_kv_shared_layers_count_once_and_each_layer_its_own_head_size():
    # gemma4: sliding layers [s, s, full] x 2, the sliding ones 1 kv head of 16 dims, the full
    # ones 1 of 32 (global_head_dim); the last `num_kv_shared_layers` reuse earlier layers' KV
    config = {
        "model_type": "gemma4_text",
        "hidden_size": 32,
        "num_hidden_layers": 6,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "vocab_size": 128,
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 8,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    }
    sliding, full = 2 * 16 * 4, 2 * 32 * 4  # (K, V) x dims x float32, one position
    alone = row_bytes({**config, "num_kv_shared_layers": 0}, 4)
    assert alone.position == 4 * sliding + 2 * full and alone.state == 0
    shared = row_bytes({**config, "num_kv_shared_layers": 2}, 4)  # layers 4 (s) and 5 (full)
    assert shared.position == 3 * sliding + 1 * full
