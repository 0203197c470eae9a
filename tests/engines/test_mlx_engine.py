"""The MLX row engine: row independence, batched decode, chunked prefill, scoring session."""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.engines.contract import EngineError
from llm_server.engines.mlx import executor as mlx_steps
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings

TOL = 1e-4


def _greedy_alone(
    engine: MLXEngine, prompt: list[int], n: int
) -> tuple[list[int], list[np.ndarray]]:
    logits = engine.prefill(0, prompt)
    tokens, seen = [], [logits]
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode([0], [tokens[-1]])[0]
        seen.append(logits)
    engine.release(0)
    return tokens, seen


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [list(rng.integers(3, 380, n)) for n in (1, 5, 17, 3, 40, 64, 9, 130)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_rows_are_independent_of_their_neighbours(arch, prompts, tiny_model_path, tiny_llama_path):
    """8 prompts prefilled at different times while other rows decode == each alone."""
    path = tiny_model_path if arch == "qwen3" else tiny_llama_path
    solo = MLXEngine(path, EngineSettings(rows=1))
    steps = 32
    expected = [_greedy_alone(solo, p, steps) for p in prompts]

    engine = MLXEngine(path, EngineSettings(rows=8))
    last: dict[int, int] = {}
    got_tokens: dict[int, list[int]] = {r: [] for r in range(8)}
    got_logits: dict[int, list[np.ndarray]] = {r: [] for r in range(8)}

    def record(row: int, logits: np.ndarray) -> None:
        got_logits[row].append(logits)
        if len(got_tokens[row]) < steps:
            last[row] = int(np.argmax(logits))
            got_tokens[row].append(last[row])

    def step() -> None:
        rows = [r for r in sorted(last) if len(got_logits[r]) <= steps]
        if rows:
            for r, lg in zip(rows, engine.decode(rows, [last[r] for r in rows]), strict=True):
                record(r, lg)

    for row, prompt in enumerate(prompts):  # a new row joins every 3 decode steps
        record(row, engine.prefill(row, prompt))
        for _ in range(3):
            step()
    while any(len(got_logits[r]) <= steps for r in range(8)):
        step()

    for row in range(8):
        tokens, logits = expected[row]
        assert got_tokens[row] == tokens, f"row {row} diverged"
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got_logits[row], logits, strict=True))
        assert diff <= TOL, f"row {row}: max abs logit diff {diff}"
        assert engine.cursor(row) == len(prompts[row]) + steps


def test_prefill_leaves_other_rows_untouched(tiny_model_path, prompts):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=3))
    engine.prefill(0, prompts[2])
    before = engine.decode([0], [5])[0]
    engine.prefill(1, prompts[7])  # long prompt into a neighbour
    engine.prefill(2, prompts[4])
    after_ref = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    after_ref.prefill(0, prompts[2])
    after_ref.decode([0], [5])
    expected = after_ref.decode([0], [9])[0]
    got = engine.decode([0], [9])[0]
    assert np.abs(got - expected).max() <= TOL
    assert before.shape == (engine.vocab_size,)


def test_chunked_prefill_equals_one_shot(tiny_model_path, monkeypatch):
    prompt = list(np.random.default_rng(1).integers(3, 380, 300))
    whole = MLXEngine(tiny_model_path, EngineSettings(rows=1)).prefill(0, prompt)
    monkeypatch.setattr(mlx_steps, "PREFILL_CHUNK", 64)
    chunked_engine = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    chunked = chunked_engine.prefill(0, prompt)
    assert np.abs(whole - chunked).max() <= TOL
    assert chunked_engine.cursor(0) == 300


def test_release_frees_memory_and_resets_cursor(tiny_model_path, prompts):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2, kv_keep_alive=0))
    engine.prefill(0, prompts[5])
    engine.prefill(1, prompts[3])
    assert engine.kv_bytes() > 0
    engine.release(0)
    assert engine.cursor(0) == 0 and engine.kv_bytes() > 0
    engine.release(1)
    assert engine.kv_bytes() == 0  # idle engine holds no KV memory


def test_bad_calls_raise_clear_errors(tiny_model_path):
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2, context_length=8))
    with pytest.raises(ValueError, match="at least one token"):
        engine.prefill(0, [])
    with pytest.raises(ValueError, match="exceeds the context of 8"):
        engine.prefill(0, list(range(3, 12)))
    with pytest.raises(ValueError, match="out of range"):
        engine.prefill(2, [3])
    engine.prefill(0, list(range(3, 11)))
    with pytest.raises(EngineError, match="full"):
        engine.decode([0], [3])


def test_missing_or_unsupported_model(tmp_path, tiny_model_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MLXEngine(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "no_such_arch"}')
    with pytest.raises(ValueError, match="not supported"):
        MLXEngine(tmp_path)


def test_scoring_session_matches_each_prompt_alone(tiny_model_path, prompts):
    """All-position logits of a right-padded batch equal per-prompt logits at real positions."""
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=2))
    engine.prefill(0, prompts[3])  # a decode row in flight must not be disturbed
    chosen = [prompts[1], prompts[2], prompts[4], prompts[0]]
    q = max(len(p) for p in chosen)
    batch = np.array([p + [p[-1]] * (q - len(p)) for p in chosen], dtype=np.int32)
    together = engine.all_position_logits(batch)
    for i, p in enumerate(chosen):
        alone = engine.all_position_logits(np.array([p], dtype=np.int32))[0]
        assert np.abs(together[i, : len(p)] - alone).max() <= TOL

    # chunked scoring through the session API: log-probs equal a log-softmax of those logits
    targets = np.roll(batch, -1, axis=1)
    engine.score_begin(len(chosen))
    first = engine.score_chunk(batch[:, :16], targets[:, :16], top_k=3)
    rest = engine.score_chunk(batch[:, 16:], targets[:, 16:], top_k=3)
    engine.score_end()
    lp = np.concatenate([first.token_logprobs, rest.token_logprobs], axis=1)
    ref = together - np.log(np.exp(together.astype(np.float64)).sum(-1, keepdims=True))
    ref_lp = np.take_along_axis(ref, targets[..., None], axis=-1)[..., 0]
    assert np.abs(lp - ref_lp).max() <= TOL
    assert first.top_ids.shape == (4, 16, 3)
    assert (first.top_ids[..., 0] == first.greedy_ids).all()
    # the decode row still continues exactly as if scoring never happened
    solo = MLXEngine(tiny_model_path, EngineSettings(rows=1))
    solo.prefill(0, prompts[3])
    assert np.abs(engine.decode([0], [7])[0] - solo.decode([0], [7])[0]).max() <= TOL
