"""The engine refuses what its contract forbids, with an error that says what was wrong, and
leaves its rows as they were (engines/contract.py; the checks of settings.py, mlx_steps.py,
mlx_decode.py, mlx_sessions.py, mlx_rows.py). Runs under either kernel set."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.contract import EngineError
from llm_server.engines.forward import compiled as compiled_step
from llm_server.engines.kv.prefix_cache import PrefixCache
from llm_server.engines.mlx import decode as mlx_decode
from llm_server.engines.mlx.dtypes import checkpoint_dtype, default_dtype
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.plan import DecodeRow, PrefillChunk, ScoreChunk, StepPlan
from llm_server.engines.probe import supports_batching
from llm_server.engines.settings import EngineSettings
from llm_server.testing.families import build_family_checkpoint

CONTEXT = 16


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rows", 0),
        ("context_length", 0),
        ("dtype", "float64"),
        ("prefix_cache_bytes", -1),
        ("parallel", "data"),
        ("score_rows", -1),
    ],
)
def test_settings_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineSettings(**{field: value})


def test_prefix_cache_refuses_a_negative_bound():
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return MLXEngine(tiny_model_path, EngineSettings(rows=2, context_length=CONTEXT))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def test_an_empty_plan_is_an_empty_step(engine):
    result = engine.run(StepPlan())
    assert result.rows == ()
    assert result.logits.shape == (0, engine.vocab_size)


def test_bad_decode_and_rewind_calls_are_refused(engine):
    engine.prefill(0, _prompt(4))
    with pytest.raises(ValueError, match="one token per row"):
        engine.decode([0], [1, 2])
    with pytest.raises(ValueError, match="holds 4 positions, not 5"):
        engine.rewind(0, 5)
    assert engine.cursor(0) == 4
    engine.release(0)


def test_bad_prompt_chunks_leave_the_rows_as_they_were(engine):
    """A step's chunks are checked inside its forward: the step fails as an engine error."""
    engine.prefill(1, _prompt(3, 1))
    with pytest.raises(EngineError, match="prompt of 0 tokens"):
        engine.run(StepPlan(prefill=(PrefillChunk(1, 0, [], 0, 0),)))
    resumed = PrefillChunk(2, 1, _prompt(8, 1), 5, 8)  # the row is at 3, not 5
    with pytest.raises(EngineError, match="row 1 is at 3"):
        engine.run(StepPlan(prefill=(resumed,)))
    assert engine.cursor(1) == 3
    engine.release(1)


def test_a_row_with_a_step_in_flight_cannot_join_another(engine):
    engine.prefill(0, _prompt(4, 2))
    step = engine.decode_start([0], [5])
    with pytest.raises(RuntimeError, match="decode step in flight"):
        engine.run(StepPlan(decode=(DecodeRow(0, 6),), prefill=(PrefillChunk(3, 1, [7], 0, 1),)))
    engine.decode_finish(step)
    assert engine.cursor(0) == 5
    engine.release(0)


def test_a_full_row_is_an_engine_error(engine):
    engine.prefill(0, _prompt(CONTEXT, 3))
    plan = StepPlan(decode=(DecodeRow(0, 5),), prefill=(PrefillChunk(4, 1, [7, 8], 0, 2),))
    with pytest.raises(EngineError, match=f"full \\({CONTEXT} positions\\)"):
        engine.run(plan)
    assert engine.cursor(0) == CONTEXT
    engine.release(0)


def test_bad_scoring_chunks_are_refused(engine):
    row = engine.rows  # the first scoring row
    assert engine.score_rows > 0
    prompt = _prompt(6, 4)
    with pytest.raises(EngineError, match="scoring chunk 4..9"):
        engine.run(StepPlan(score=(ScoreChunk(1, row, prompt, 4, 9, 0),)))
    engine.run(StepPlan(score=(ScoreChunk(1, row, prompt, 0, 3, 0),)))
    with pytest.raises(EngineError, match=f"scoring row {row} is at 3"):
        engine.run(StepPlan(score=(ScoreChunk(1, row, prompt, 4, 6, 0),)))


def test_sessions_are_opened_before_use_and_kept_in_context(engine):
    with pytest.raises(RuntimeError, match="score_begin"):
        engine.score_chunk(np.ones((1, 2), np.int32), np.ones((1, 2), np.int32), 0)
    with pytest.raises(ValueError, match="at least one row"):
        engine.score_begin(0)
    with pytest.raises(RuntimeError, match="embed_begin"):
        engine.embed_chunk(np.ones((1, 2), np.int32))
    engine.embed_begin(1)
    with pytest.raises(ValueError, match=f"past the context of {CONTEXT}"):
        engine.embed_chunk(np.ones((1, CONTEXT + 1), np.int32))
    engine.embed_end()


def test_weight_bytes_count_the_float32_weights(engine):
    embedding = engine.vocab_size * engine.model.args.hidden_size * 4
    assert embedding < engine.weight_bytes() < 100 * embedding


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


def test_a_failing_forward_is_an_engine_error_and_leaves_the_rows(engine, monkeypatch):
    """Each entry point turns a forward's exception into an EngineError (the scheduler fails
    that request alone) and the rows keep what they held; the engine serves on after it."""
    prompt = _prompt(4, 5)
    engine.prefill(0, prompt)
    with monkeypatch.context() as m:
        m.setattr(engine.forward, "graph", _boom)
        with pytest.raises(EngineError, match="forward failed: boom"):
            engine.decode_start([0], [5])
        m.setattr(engine.forward, "run_groups", _boom)
        with pytest.raises(EngineError, match="forward failed: boom"):
            engine.prefill(1, _prompt(3, 6))
        m.setattr(type(engine.kernels), "reduce_scores", _boom)
        engine.score_begin(1)
        with pytest.raises(EngineError, match="scoring forward failed: boom"):
            engine.score_chunk(np.ones((1, 2), np.int32), np.ones((1, 2), np.int32), 0)
        engine.score_end()
        engine.embed_begin(1)  # its caches from the model, before the stack fails
        m.setattr(engine.embedding, "model", SimpleNamespace(**{engine.embedding.inner: _boom}))
        with pytest.raises(EngineError, match="embedding forward failed: boom"):
            engine.embed_chunk(np.ones((1, 2), np.int32))
        engine.embed_end()
    assert engine.cursor(0) == 4 and engine.row_table.ahead[0] == 0
    assert engine.decode([0], [5]).shape == (1, engine.vocab_size)
    assert engine.cursor(0) == 5
    engine.release(0)
    engine.release(1)


def test_a_model_without_a_decoder_stack_cannot_embed(engine, monkeypatch):
    monkeypatch.setattr(engine.embedding, "inner", None)
    engine.embed_begin(1)
    with pytest.raises(Exception, match="no decoder stack known to embed with"):
        engine.embed_chunk(np.ones((1, 2), np.int32))
    engine.embed_end()


def test_rows_past_the_store_and_rewinds_without_drafts_are_refused(engine, monkeypatch):
    store = engine.row_table.store
    with pytest.raises(ValueError, match="out of range"):
        store.ensure_rows(store.total_rows + 1)
    monkeypatch.setattr(engine, "speculative", False)
    with pytest.raises(EngineError, match="cannot be rewound"):
        engine.rewind(0, 0)


def test_a_step_that_fails_to_finish_or_cancel_leaves_its_rows(engine, monkeypatch):
    """A started decode step whose evaluation fails: finishing it is an EngineError, cancelling
    it is quiet; either way its rows do not advance and take the next step."""
    engine.prefill(0, _prompt(4, 7))
    failing_mlx = SimpleNamespace(eval=_boom)
    for end in (engine.decode_finish, engine.decode_cancel):
        step = engine.decode_start([0], [5])
        with monkeypatch.context() as m:
            m.setattr(mlx_decode, "mx", failing_mlx)
            if end == engine.decode_finish:
                with pytest.raises(EngineError, match="forward failed: boom"):
                    end(step)
            else:
                end(step)
        assert engine.cursor(0) == 4 and engine.row_table.ahead[0] == 0
    assert engine.decode([0], [5]).shape == (1, engine.vocab_size)
    engine.release(0)


def test_a_step_keeps_an_engine_errors_own_message_and_reopens_nothing(engine, monkeypatch):
    monkeypatch.setattr(engine.forward, "run_groups", _raise(EngineError("the store is gone")))
    with pytest.raises(EngineError, match="^the store is gone$"):
        engine.run(StepPlan(prefill=(PrefillChunk(1, 1, _prompt(3, 8), 0, 3),)))
    assert engine.cursor(1) == 0


def test_drafts_on_an_engine_that_cannot_verify_them_are_refused(engine, monkeypatch):
    monkeypatch.setattr(engine.executor, "speculative", False)
    with pytest.raises(EngineError, match="drafts cannot be verified"):
        engine.run(StepPlan(decode=(DecodeRow(0, 5, (6, 7)),)))


def test_compiled_graphs_stay_within_their_bound(tiny_model_path, monkeypatch):
    monkeypatch.setattr(compiled_step, "MAX_GRAPHS", 1)
    compiled = MLXEngine(tiny_model_path, EngineSettings(rows=2, compiled_decode=True))
    assert compiled.fused is not None and compiled.fused.compiled is not None
    compiled.prefill(0, _prompt(4, 9))
    compiled.prefill(1, _prompt(4, 10))
    one, both = compiled.decode([0], [5]), compiled.decode([0, 1], [6, 7])
    assert one.shape == (1, compiled.vocab_size) and both.shape == (2, compiled.vocab_size)
    assert compiled.fused.compiled.traces == 2
    assert len(compiled.fused.compiled._local.graphs) == 1  # the first shape's graph dropped


def test_a_checkpoint_whose_dtype_cannot_be_read_is_float32(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{}")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"ids": mx.zeros((2,), mx.int32)})
    assert checkpoint_dtype(tmp_path) is None  # no floating-point tensor to read it from
    assert default_dtype(tmp_path, on_cpu=False) == "float32"


def test_without_the_converters_package_a_model_folder_batches(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "converters.manifest", None)  # an install without them
    assert supports_batching(tmp_path)


def _raise(exc: Exception):
    def fail(*args, **kwargs):
        raise exc

    return fail


def test_a_failed_step_puts_a_recurrent_rows_state_back(tmp_path, monkeypatch):
    """lfm2 carries a convolution state per row: a step whose forward ran but then failed
    leaves the row's state as before it, so the row's next token is the one it gets without
    the failure (an engine that never failed gives it)."""
    path = build_family_checkpoint(tmp_path / "lfm2", "lfm2")
    ref, failing = (MLXEngine(path, EngineSettings(rows=2)) for _ in range(2))
    assert failing.layout.stateful
    prompt = _prompt(6, 11)
    ref.prefill(0, prompt)
    failing.prefill(0, prompt)
    forward = failing.forward.run_groups

    def forward_then_fail(*args, **kwargs):
        forward(*args, **kwargs)  # the rows' states are written
        raise RuntimeError("boom")

    monkeypatch.setattr(failing.forward, "run_groups", forward_then_fail)
    plan = StepPlan(decode=(DecodeRow(0, 5),), prefill=(PrefillChunk(1, 1, _prompt(3, 12), 0, 3),))
    with pytest.raises(EngineError, match="forward failed: boom"):
        failing.run(plan)
    monkeypatch.undo()
    assert np.array_equal(failing.decode([0], [5]), ref.decode([0], [5]))
