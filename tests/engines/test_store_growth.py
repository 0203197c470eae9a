"""How the KV store grows (row_cache.RowStore.ensure, ensure_rows): each growth copies the whole
store into fresh memory, so it grows by at least a quarter of what it holds, a row opened for a
prompt grows it for the whole prompt at once rather than chunk by chunk, and it holds the
serving rows in use (in powers of two), not all of them."""

from __future__ import annotations

import mlx.core as mx

from llm_server.engines.kv.store import GROW, RowStore
from llm_server.engines.mlx.engine import MLXEngine
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
    store.allocate(0, 1, 4, 4, mx.float32)
    held = store.keys[0]
    store.reserve(8100)  # the store at the model's context already: left as it is, not copied
    assert store.capacity == 8192 and store.keys[0] is held


def test_a_conversations_next_turn_does_not_grow_the_store_while_it_fits():
    store = RowStore(num_layers=1, rows=1, max_positions=16384)
    store.reserve(3671)  # a chat's first turn: 3,671 + 917, in whole GROWs
    assert store.capacity == 4608
    for prompt in (3695, 3719, 4100, 4608 - GROW):  # later turns: the store as it is
        store.reserve(prompt)
        assert store.capacity == 4608
    store.reserve(4608 - GROW + 1)  # less than a GROW left after it: grows by a quarter of
    assert store.capacity == 5888  # the store (4,608 + 1,152), in whole GROWs


def test_a_prompt_opened_on_a_row_grows_the_store_for_all_of_it(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2))
    prompt = [(7 * i) % 300 + 3 for i in range(700)]
    assert engine.row_table.open(0, prompt) == 0
    assert engine.row_table.store.capacity == 3 * GROW  # before its first chunk runs
    logits = engine.prefill(1, prompt[:40])
    assert engine.row_table.store.capacity == 3 * GROW and logits.shape[-1] == engine.vocab_size


def test_serving_rows_come_in_powers_of_two_and_scoring_rows_all_at_once():
    store = RowStore(num_layers=1, rows=6 + 8, max_positions=4096, first_rows=6)
    keys = [mx.arange(3 * 20 * 4, dtype=mx.float32).reshape(3, 20, 4)]
    store.write_prefix(0, keys, keys, 20)
    assert store.rows == 1 and store.keys[0].shape == (1, 3, GROW, 4)
    held = []
    for row in (1, 2, 3, 4, 5):
        store.write_prefix(row, [k + row for k in keys], keys, 20)
        held.append(store.keys[0].shape[0])
    assert held == [2, 4, 4, 6, 6]  # 1, 2, 4, then the 6 serving rows
    store.ensure_rows(7)  # a scoring row: all 8 scoring rows
    assert store.rows == 14 and store.nbytes() == 14 * 2 * 3 * GROW * 4 * 4
    for row in range(6):  # every row's positions survived each growth's copy
        assert mx.array_equal(store.read_row(row, 20)[0][0], keys[0] + row)
    store.clear()
    assert store.rows == 1 and store.nbytes() == 0


def test_one_request_at_a_time_holds_one_rows_kv(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=4, prefix_cache_bytes=0))
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    for _ in range(2):  # a conversation's turns, one after another, on the lowest free row
        engine.prefill(0, prompt)
        engine.release(0)
    engine.prefill(0, prompt)
    assert {k.shape[0] for k in engine.row_table.store.keys if k is not None} == {1}
    engine.prefill(2, prompt)  # a third concurrent request's row: rows 0-3 held
    assert {k.shape[0] for k in engine.row_table.store.keys if k is not None} == {4}
