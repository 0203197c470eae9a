"""A released row keeps its history in the store: the next prompt that shares it, opened on that
row, reuses the prefix in place (no copy) with the logits of a cold prefill; the idle store goes
back after the keep-alive (mlx_rows.RowTable, EngineSettings.kv_keep_alive); a restart over a
prefix cache folder resumes the last conversations into the rows at load."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings


@pytest.fixture(scope="module")
def turns() -> tuple[list[int], list[int], list[int]]:
    rng = np.random.default_rng(11)
    first = [int(t) for t in rng.integers(3, 380, 150)]
    second = first + [int(t) for t in rng.integers(3, 380, 40)]  # the next turn: history + new
    other = [int(t) for t in rng.integers(3, 380, 60)]  # an unrelated request in between
    return first, second, other


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(path, clock: Clock | None = None, **kw) -> MLXEngine:
    engine = MLXEngine(path, EngineSettings(rows=2, **kw))
    if clock is not None:
        engine.row_table._clock = clock
    return engine


def _copied(path, first: list[int], second: list[int]) -> np.ndarray:
    """`second`'s logits with `first`'s KV copied in from the prefix cache (another row)."""
    engine = _engine(path)
    engine.prefill(1, first)
    engine.release(1)
    logits = engine.prefill(0, second)
    assert engine.cached_tokens(0) == len(first)
    return logits


def test_next_turn_reuses_its_row_in_place(tiny_model_path, turns, monkeypatch):
    """The logits of the copy it replaces, bit for bit (the same KV), and a cold prefill's
    within float32 rounding (the prompt ran in two chunks, not one)."""
    first, second, _ = turns
    cold = _engine(tiny_model_path, prefix_cache_bytes=0).prefill(0, second)
    copied = _copied(tiny_model_path, first, second)
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    engine.release(0)
    assert engine.kv_bytes() > 0  # kept through the keep-alive
    assert engine.preferred_row(second, [0, 1]) == 0
    copies = []
    monkeypatch.setattr(
        engine.row_table.store, "write_prefix", lambda *a: copies.append(a), raising=True
    )
    got = engine.prefill(0, second)
    assert copies == []  # nothing copied: the row's own KV
    assert engine.cached_tokens(0) == len(first)
    assert np.array_equal(got, copied)
    assert np.abs(got - cold).max() <= 1e-4 and got.argmax() == cold.argmax()


def test_an_unrelated_request_takes_another_row(tiny_model_path, turns):
    first, second, other = turns
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    engine.release(0)
    assert engine.preferred_row(other, [0, 1]) == 1  # the row keeping nothing
    engine.prefill(1, other)
    engine.release(1)
    # both rows keep a history: the one released longest ago is given up first
    unrelated = [5] * 30
    assert engine.preferred_row(unrelated, [0, 1]) == 0
    assert engine.preferred_row(second, [0, 1]) == 0
    assert engine.preferred_row(other + [9, 9], [1, 0]) == 1


def test_a_row_opened_for_another_prompt_no_longer_offers_its_history(tiny_model_path, turns):
    first, second, other = turns
    copied = _copied(tiny_model_path, first, second)
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    engine.release(0)
    engine.prefill(0, other)  # row 0 overwritten
    engine.release(0)
    assert engine.row_table._kept_prefix(0, second) == 0
    got = engine.prefill(1, second)  # from the prefix cache's copy instead
    assert engine.cached_tokens(1) == len(first)
    assert np.array_equal(got, copied)


def _cached(engine: MLXEngine) -> tuple[int, int]:
    """(prefix cache entries, positions kept only in the rows)."""
    return engine.prefix_cache.stats().entries, engine.kept_tokens()


def test_a_kept_history_is_copied_to_the_cache_only_when_about_to_be_lost(tiny_model_path, turns):
    first, second, other = turns
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    assert _cached(engine) == (0, 0)  # busy rows keep nothing yet
    engine.release(0)
    assert _cached(engine) == (0, len(first))
    engine.prefill(0, second)  # the next turn carries it on, in place: still no copy
    engine.release(0)
    assert _cached(engine) == (0, len(second))
    # a prompt that drops it: copied before the row is overwritten
    engine.prefill(0, other)
    assert _cached(engine) == (1, 0)
    assert engine.prefix_cache.match(second + [7])[1] == len(second)
    engine.release(0)
    assert _cached(engine) == (1, len(other))
    engine.row_table.save_kept()  # as when the store goes back or the engine stops
    assert _cached(engine) == (2, 0)


def test_a_prompt_carrying_on_all_but_a_short_tail_replaces_it_uncopied(tiny_model_path, turns):
    """An agent's next turn re-renders the end of the last answer: up to 64 kept tokens it
    does not carry on are dropped with the history, not copied."""
    first, _, other = turns
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    engine.release(0)
    engine.prefill(0, first[:-60] + other[:10])
    assert engine.cached_tokens(0) == len(first) - 60 and _cached(engine) == (0, 0)
    engine.release(0)
    engine.prefill(0, first[:30] + other[:10])  # 70 of the 100 kept positions dropped
    assert _cached(engine) == (1, 0)


def test_another_row_reuses_a_kept_history_from_its_row(tiny_model_path, turns):
    """A prompt sharing a free row's history, opened elsewhere, copies it from that row (the
    prefix cache does not hold it): the logits of reusing it in place."""
    first, second, _ = turns
    here = _engine(tiny_model_path)
    here.prefill(0, first)
    here.release(0)
    in_place = here.prefill(0, second)
    engine = _engine(tiny_model_path)
    engine.prefill(0, first)
    engine.release(0)
    got = engine.prefill(1, second)
    assert engine.cached_tokens(1) == len(first) and _cached(engine) == (0, len(first))
    assert np.array_equal(got, in_place)


def test_idle_store_goes_back_after_the_keep_alive(tiny_model_path, turns):
    first, second, _ = turns
    clock = Clock()
    engine = _engine(tiny_model_path, clock, kv_keep_alive=30)
    assert engine.idle_due() is None
    engine.prefill(0, first)
    assert engine.idle_due() is None  # a row is busy
    engine.release(0)
    assert engine.idle_due() == 30
    clock.now += 29
    assert not engine.trim_idle() and engine.kv_bytes() > 0
    clock.now += 1
    assert engine.trim_idle() and engine.kv_bytes() == 0 and engine.idle_due() is None
    engine.prefill(0, second)  # the prefix cache still has the history
    assert engine.cached_tokens(0) == len(first)


def test_no_keep_alive_or_no_prefix_cache_gives_the_store_back_at_once(tiny_model_path, turns):
    first, _, _ = turns
    for kw in ({"kv_keep_alive": 0}, {"prefix_cache_bytes": 0}):
        engine = _engine(tiny_model_path, **kw)
        engine.prefill(0, first)
        engine.release(0)
        assert engine.kv_bytes() == 0 and engine.idle_due() is None, kw


def test_keep_alive_must_be_non_negative():
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="kv_keep_alive"):
            EngineSettings(kv_keep_alive=bad)


def _persisted(path, folder, history: list[int]) -> None:
    """A server that served `history` and shut down: its entry on disk in `folder`."""
    engine = _engine(path, prefix_cache_dir=folder)
    engine.prefill(0, history)
    engine.release(0)
    engine.persist()  # as at shutdown (thread_exit): the kept history to disk too


def test_a_restart_resumes_the_last_conversation_into_its_row(tiny_model_path, tmp_path, turns):
    """Read back at load (not at the next turn), in place, with the logits of a lazy disk hit."""
    first, second, other = turns
    history = first * 2  # 300 tokens: a read worth its file (prefix_disk.READ_TOKENS)
    turn = history + other[:20]
    _persisted(tiny_model_path, tmp_path, history)
    # no resume: read at the hit, copied
    lazy = _engine(tiny_model_path, kv_keep_alive=0, prefix_cache_dir=tmp_path)
    assert lazy.kv_bytes() == 0
    want = lazy.prefill(0, turn)
    assert lazy.cached_tokens(0) == len(history)

    engine = _engine(tiny_model_path, prefix_cache_dir=tmp_path)
    disk = engine.prefix_cache.disk
    assert disk.reads == 1 and engine.row_table.kept[0] == history
    assert engine.preferred_row(other, [0, 1]) == 1  # an unrelated request leaves it alone
    assert engine.preferred_row(turn, [0, 1]) == 0
    copies = []
    engine.row_table.store.write_prefix = lambda *a: copies.append(a)
    got = engine.prefill(0, turn)
    assert copies == [] and disk.reads == 1  # in place; nothing read at the turn
    assert engine.cached_tokens(0) == len(history)
    assert np.array_equal(got, want)


def test_a_corrupt_file_is_not_resumed(tiny_model_path, tmp_path, turns, caplog):
    first, _, other = turns
    history = first * 2
    _persisted(tiny_model_path, tmp_path, history)
    (path,) = tmp_path.glob("kv_*/*.kv")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        engine = _engine(tiny_model_path, prefix_cache_dir=tmp_path)
    assert engine.row_table.kept == [[]] * len(engine.row_table.kept)
    assert engine.kv_bytes() == 0 and engine.prefix_cache.disk.corrupt == 1
    assert any("checksum" in r.getMessage() for r in caplog.records)
    engine.prefill(0, history + other[:20])
    assert engine.cached_tokens(0) == 0  # computed cold
