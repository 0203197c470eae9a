"""The fused decode step: the same logits as mlx-lm's forward, weights held once, safe fallbacks."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from llm_server.engines.forward.fused import FusedForward
from llm_server.engines.forward.layers import rope_table, table_matches
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.native import blas
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory, tiny_model_path, tiny_llama_path):
    qwen2 = build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-qwen2", TinySpec(arch="qwen2")
    )
    return {"qwen3": tiny_model_path, "llama": tiny_llama_path, "qwen2": qwen2}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_fused_steps_equal_the_mlx_lm_forward(arch, arch_paths):
    """Prefill (split, unsplit, numpy attention, two chunks) and decode steps over rows at
    different cursors, all rows and gathered subsets: logits match, tokens are equal."""
    fused = MLXEngine(arch_paths[arch], EngineSettings(rows=4))
    plain = MLXEngine(arch_paths[arch], EngineSettings(rows=4, fused_decode=False))
    assert fused.fused is not None and fused.fused.table is not None
    assert plain.fused is None
    rng = np.random.default_rng(3)
    last = {}
    for row, n in enumerate((3, 130, 1, 600)):
        prompt = rng.integers(3, 380, n).tolist()
        a, b = fused.prefill(row, prompt), plain.prefill(row, prompt)
        np.testing.assert_allclose(a, b, atol=1e-5)
        last[row] = int(np.argmax(a))
    for step in range(24):
        rows = [[0, 1, 2, 3], [0, 2], [3], [1, 2, 3]][step % 4]
        toks = [last[r] for r in rows]
        a, b = fused.decode(rows, toks), plain.decode(rows, toks)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        last.update(zip(rows, a.argmax(-1).tolist(), strict=True))
    assert [fused.cursor(r) for r in range(4)] == [plain.cursor(r) for r in range(4)]


def _address(a: mx.array) -> int:
    return np.array(a, copy=False).__array_interface__["data"][0]


def test_stacked_weights_are_held_once(tiny_model_path):
    """q/k/v and gate/up of the model are views into the stacked weights, not copies."""
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    layer, fused = engine.model.model.layers[0], engine.fused.layers[0]
    base = _address(fused.qkv.weight)
    row_bytes = fused.qkv.weight.shape[1] * 4
    attn = layer.self_attn
    q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert _address(attn.q_proj.weight) == base
    assert _address(attn.k_proj.weight) == base + q_rows * row_bytes
    assert _address(attn.v_proj.weight) == base + (q_rows + k_rows) * row_bytes
    half = fused.qkv.weight.shape[0] // 2  # the split halves and the transpose are views too
    assert _address(fused.qkv.wt) == _address(fused.qkv.halves[0]) == base
    assert _address(fused.qkv.halves[1]) == base + half * row_bytes
    inter = layer.mlp.gate_proj.weight.shape[0]
    assert _address(layer.mlp.gate_proj.weight) == _address(fused.gate_up.weight)
    assert _address(layer.mlp.up_proj.weight) == _address(fused.gate_up.weight) + inter * row_bytes


def test_quantized_layers_keep_the_mlx_lm_forward(tiny_llama_path):
    engine = MLXEngine(tiny_llama_path, EngineSettings(rows=1, fused_decode=False))
    nn.quantize(engine.model, group_size=32, bits=8)
    assert FusedForward.build(engine.model, 64, engine.kernels) is None


def test_rope_table_reproduces_scaled_rope_and_refuses_others():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    rope = initialize_rope(64, 500000.0, False, scaling, 4096)
    table = rope_table(rope, 64, 1024, mx.float32)
    assert table is not None and table.shape == (1024, 64)
    assert not table_matches(table, nn.RoPE(64, base=500000.0))  # no scaling: other angles
    assert rope_table(nn.RoPE(64, traditional=True), 64, 16, mx.float32) is None
    assert rope_table(nn.RoPE(32), 64, 16, mx.float32) is None  # partial rotary


def test_blis_thread_setter_applies_and_restores():
    if not blas.threads_settable():
        pytest.skip("BLIS with its runtime thread setter is not the mapped BLAS")
    get = ctypes.CDLL(None).bli_thread_get_num_threads
    get.restype = ctypes.c_int64
    with blas.threads(1):
        assert get() == 1
        assert blas.check_blas()  # products stay right on one thread
    assert get() == blas.default_threads()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_scoring_chunks_equal_the_mlx_lm_forward(arch, arch_paths):
    """A padded scoring batch over several chunks (split and unsplit sizes) scores the same."""
    from llm_server.engines.contract import SCORE_CHUNK

    rng = np.random.default_rng(5)
    tokens = rng.integers(3, 380, (3, 301)).astype(np.int32)
    results = []
    for fused in (True, False):
        engine = MLXEngine(arch_paths[arch], EngineSettings(rows=1, fused_decode=fused))
        engine.score_begin(3)
        chunks = []
        for s in range(0, 300, SCORE_CHUNK):
            e = min(s + SCORE_CHUNK, 300)
            chunks.append(engine.score_chunk(tokens[:, s:e], tokens[:, s + 1 : e + 1], 3))
        engine.score_end()
        results.append(chunks)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-5)
        np.testing.assert_array_equal(a.greedy_ids, b.greedy_ids)
        np.testing.assert_array_equal(a.top_ids, b.top_ids)


def test_prompt_positions_attend_alike_wherever_their_chunk_starts(tiny_llama_path, monkeypatch):
    """With the decode ops (llm_server.native.decode_ops), prompt chunks attend through them
    as decode steps do: one arithmetic per position, whatever chunk it is in. A prompt's logits
    are the same bit for bit prefilled whole on a fresh store, after its first 60 tokens came
    from the prefix cache (the store cleared in between, as an idle server's is), and in chunks
    of 16; and its first generated tokens are the same. No position attends through numpy,
    MLX's attention or decode_attention's MLX ops, not even on the fresh store's first write."""
    from llm_server.engines.mlx import executor as mlx_steps
    from llm_server.native import cpu_kernels, decode_attention

    engine = MLXEngine(tiny_llama_path, EngineSettings(rows=1))
    if engine.fused is None or engine.fused.k.ops is None:
        pytest.skip("the decode ops do not apply here (not Linux's CPU)")

    def elsewhere(*args, **kwargs):
        raise AssertionError("a position attended outside the decode ops")

    monkeypatch.setattr(cpu_kernels, "attention", elsewhere)
    monkeypatch.setattr(decode_attention, "attend", elsewhere)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", elsewhere)
    rng = np.random.default_rng(12)
    first = rng.integers(3, 380, 90).tolist()
    prompt = first[:60] + rng.integers(3, 380, 30).tolist()

    def run(engine: MLXEngine) -> tuple[np.ndarray, list[int], np.ndarray]:
        prefilled = logits = engine.prefill(0, prompt)
        tokens = []
        for _ in range(6):
            tokens.append(int(np.argmax(logits)))
            logits = engine.decode([0], tokens[-1:])[0]
        engine.release(0)
        return prefilled, tokens, logits

    whole = run(engine)
    assert engine.cached_tokens(0) == 0
    engine = MLXEngine(tiny_llama_path, EngineSettings(rows=1))
    engine.prefill(0, first)
    engine.release(0)  # `first` goes to the prefix cache; the idle store is cleared
    cached = run(engine)
    assert engine.cached_tokens(0) == 60
    monkeypatch.setattr(mlx_steps, "PREFILL_CHUNK", 16)
    chunked = run(MLXEngine(tiny_llama_path, EngineSettings(rows=1)))
    assert cached[1] == whole[1] and chunked[1] == whole[1]
    for a, b in ((cached, whole), (chunked, whole)):
        np.testing.assert_array_equal(a[0], b[0])  # the prompt's last position
        np.testing.assert_array_equal(a[2], b[2])  # after 6 decode steps
