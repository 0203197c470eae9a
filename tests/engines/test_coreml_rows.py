"""The Core ML engine's Python side on any OS: its row driver, step plans run by primitives,
package lookup and its errors, over a stand-in for MLModel (only loading a package and
predicting with Core ML need macOS; tests/converters/test_coreml_serving.py runs the
interpreted graph end to end)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from llm_server.engines.contract import EngineError
from llm_server.engines.coreml.engine import (
    CoreMLEngine,
    RowDriver,
    _package_of,
    require_macos_15,
    run_by_primitives,
)
from llm_server.engines.plan import PrefillChunk, ScoreChunk, StepPlan

VOCAB = 8


def _forward(inputs: dict, session: str) -> np.ndarray:
    """Logits [rows, q, vocab]: each position's logit 0 holds its position (to see the rows)."""
    positions = inputs["position_ids"]
    out = np.zeros((*positions.shape, VOCAB), np.float32)
    out[..., 0] = positions
    return out


def test_the_row_driver_refuses_what_its_graph_cannot_hold():
    driver = RowDriver(2, 4, [1, 4], _forward)
    for prompt in ([], [1] * 5):
        with pytest.raises(ValueError, match="does not fit 1..4"):
            driver.prefill(0, prompt)
    assert driver.prefill(0, [1, 2, 3, 4])[0] == 3  # the last position's logits
    with pytest.raises(EngineError, match="row 0 is full \\(4 positions\\)"):
        driver.decode([0], [5])
    assert driver.decode([1], [5])[0, 0] == 0  # a fresh row writes at position 0
    with pytest.raises(ValueError, match="does not fit the graph"):
        driver.score_chunk(np.ones((3, 2), np.int32), np.ones((3, 2), np.int32), 0)


def test_plans_by_primitives_refuse_scoring_and_resumed_prompts():
    engine = SimpleNamespace(name="coreml")
    score = ScoreChunk(1, 2, [1, 2, 3], 0, 2, 0)
    with pytest.raises(ValueError, match="coreml has no scoring rows"):
        run_by_primitives(engine, StepPlan(score=(score,)))
    resumed = PrefillChunk(1, 0, [1, 2, 3], 1, 3)
    with pytest.raises(ValueError, match="cannot resume a prompt at position 1"):
        run_by_primitives(engine, StepPlan(prefill=(resumed,)))


def test_a_folder_is_served_by_its_first_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .mlpackage found"):
        _package_of(tmp_path)
    for name in ("b.mlpackage", "a.mlpackage"):
        (tmp_path / name).mkdir()
    assert _package_of(tmp_path) == tmp_path / "a.mlpackage"


def test_an_unreadable_macos_version_leaves_the_check_to_core_ml():
    require_macos_15("darwin", "15.1")
    require_macos_15("darwin", "unknown")  # no error: Core ML itself decides at load
    with pytest.raises(RuntimeError, match="macOS 15 or later"):
        require_macos_15("darwin", "14.6")


class _FailingModel:
    user_defined_metadata = {
        "llm_manifest": json.dumps(
            {"rows": 2, "context_length": 8, "vocab_size": VOCAB, "q_sizes": [1, 8]}
        )
    }

    def make_state(self):
        return object()

    def predict(self, inputs, state=None):
        raise RuntimeError("Error computing NN outputs")


def test_a_failing_predict_is_an_engine_error_naming_core_ml():
    engine = CoreMLEngine("x.mlpackage", model=_FailingModel())
    with pytest.raises(EngineError, match="Core ML predict failed: Error computing NN outputs"):
        engine.prefill(0, [1, 2])
