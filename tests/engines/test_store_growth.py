"""How the KV store grows (row_cache.RowStore.ensure): each growth copies the whole store into
fresh memory, so it grows by at least a quarter of what it holds, and a row opened for a prompt
grows it for the whole prompt at once rather than chunk by chunk."""

from __future__ import annotations

import mlx.core as mx

from llm_server.engines.mlx_engine import MLXEngine
from llm_server.engines.row_cache import GROW, RowStore
from llm_server.engines.settings import EngineSettings


def test_growth_is_at_least_grow_positions_and_a_quarter_of_the_capacity():
    store = RowStore(num_layers=2, rows=2, max_positions=5000)
    store.ensure(10)
    assert store.capacity == GROW
    store.ensure(GROW + 1)
    assert store.capacity == 2 * GROW  # a quarter of 256 is less than GROW
    store.ensure(4 * GROW)
    assert store.capacity == 4 * GROW
    store.ensure(4 * GROW + 1)
    assert store.capacity == 5 * GROW  # 1,024 + 256
    store.ensure(3000)
    assert store.capacity == 3072
    store.ensure(3073)  # 3,072 + 768 = 3,840
    assert store.capacity == 3840
    store.ensure(3841)
    assert store.capacity == 4864  # 3,840 + 960, in whole GROWs
    store.ensure(4865)
    assert store.capacity == 5000  # never past max_positions
    store.ensure(10)
    assert store.capacity == 5000


def test_a_grown_store_keeps_every_rows_positions():
    store = RowStore(num_layers=1, rows=2, max_positions=4096)
    keys = [mx.arange(3 * 300 * 4, dtype=mx.float32).reshape(3, 300, 4)]
    store.write_prefix(1, keys, [k + 1 for k in keys], 300)
    assert store.capacity == 2 * GROW
    store.ensure(2 * GROW + 1)
    assert store.capacity == 3 * GROW and store.keys[0].shape == (2, 3, 3 * GROW, 4)
    got_k, got_v = store.read_row(1, 300)
    assert mx.array_equal(got_k[0], keys[0]) and mx.array_equal(got_v[0], keys[0] + 1)
    assert not store.read_row(0, 300)[0][0].any()


def test_a_long_prompt_reserves_a_quarter_more():
    store = RowStore(num_layers=1, rows=1, max_positions=8192)
    store.reserve(4 * GROW)  # a few GROWs: what it needs
    assert store.capacity == 4 * GROW
    store.reserve(3832)  # 3,832 + 958, in whole GROWs: the next turn of ~800 tokens fits
    assert store.capacity == 4864
    store.reserve(8000)
    assert store.capacity == 8192


def test_a_prompt_opened_on_a_row_grows_the_store_for_all_of_it(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2))
    prompt = [(7 * i) % 300 + 3 for i in range(700)]
    assert engine.row_table.open(0, prompt) == 0
    assert engine.row_table.store.capacity == 3 * GROW  # before its first chunk runs
    logits = engine.prefill(1, prompt[:40])
    assert engine.row_table.store.capacity == 3 * GROW and logits.shape[-1] == engine.vocab_size
