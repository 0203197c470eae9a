"""llm_server/benchmark/step.py: the compiled and eager engines decode the same prompts alike
(bit for bit); step_parts.py: a compiled step's time by part."""

from __future__ import annotations

from llm_server.benchmark import step_parts
from llm_server.benchmark.step import measure


def test_step_benchmark_compares_like_with_like_on_a_small_vocabulary(tiny_model_path):
    """The tiny vocabulary (384 ids) is smaller than the benchmark's id range: prompts stay
    inside it, so both engines see valid ids and agree."""
    times = measure(str(tiny_model_path), rows=2, steps=3, prompt_len=60)  # ids up to 7 * 64
    assert len(times.compiled_ms) == len(times.eager_ms) == 3
    assert times.same_tokens and times.max_abs_diff == 0.0


def test_step_parts_prints_every_part(tiny_llama_path, capsys):
    step_parts.main(["--model", str(tiny_llama_path), "--rows", "2", "--reps", "2"])
    out = capsys.readouterr().out
    for part in ("products", "attention", "norms", "whole step", "rest"):
        assert f"| 2 | {part}" in out
