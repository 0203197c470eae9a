"""The compiled decode step: the same logits, bit for bit, and tokens as the eager step.

Both attend over the same span of each row's store with the same arithmetic
(decode_attention), and compiling changes no rounding on the CPU, so the logits are equal
exactly: across span and capacity boundaries, for subsets of rows, on another thread.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llm_server.engines.decode_attention import SPAN
from llm_server.engines.mlx_engine import MLXEngine
from llm_server.engines.row_cache import GROW
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-qwen2", TinySpec(arch="qwen2")
    )


def _pair(path, rows: int) -> tuple[MLXEngine, MLXEngine]:
    compiled = MLXEngine(path, rows=rows)  # on by default on the CPU
    eager = MLXEngine(path, rows=rows, compiled_decode=False)
    assert compiled._fused is not None and compiled._fused.compiled is not None
    assert eager._fused.compiled is None
    return compiled, eager


def _run_steps(compiled, eager, row_sets, last, steps):
    """Alternate the row sets for `steps` decode steps on both engines; each step's logits
    equal bit for bit."""
    for step in range(steps):
        rows = row_sets[step % len(row_sets)]
        toks = [last[r] for r in rows]
        a, b = compiled.decode(rows, toks), eager.decode(rows, toks)
        np.testing.assert_array_equal(a, b)
        last.update(zip(rows, a.argmax(-1).tolist(), strict=True))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_compiled_steps_equal_eager_across_span_and_capacity(
    arch, tiny_model_path, tiny_llama_path, qwen2_path
):
    """Rows at different cursors, all rows and gathered subsets, across SPAN boundaries and the
    store's growth from GROW to 2 * GROW positions."""
    path = {"qwen3": tiny_model_path, "llama": tiny_llama_path, "qwen2": qwen2_path}[arch]
    compiled, eager = _pair(path, rows=4)
    rng = np.random.default_rng(11)
    last = {}
    for row, n in enumerate((GROW - 6, 3, SPAN - 2, 40)):  # row 0 crosses GROW during the run
        prompt = rng.integers(3, 380, n).tolist()
        a, b = compiled.prefill(row, prompt), eager.prefill(row, prompt)
        np.testing.assert_array_equal(a, b)  # prefill is not compiled: the same forward
        last[row] = int(np.argmax(a))
    assert compiled._store.capacity == GROW
    _run_steps(compiled, eager, [[0, 1, 2, 3], [0, 2], [3], [1, 2, 3]], last, steps=24)
    assert compiled._store.capacity == 2 * GROW  # the store grew under the compiled step
    assert [compiled.cursor(r) for r in range(4)] == [eager.cursor(r) for r in range(4)]
    assert compiled.cursor(0) > GROW and compiled.cursor(2) > SPAN
    # graphs per (rows, capacity, span, ...), not per step
    assert 4 <= compiled._fused.compiled.traces < 24


def test_a_released_row_and_a_new_prompt_reuse_the_graphs(tiny_llama_path):
    """Releasing and refilling rows (stale store contents past the new cursor) changes
    nothing: masked positions never leak into the result."""
    compiled, eager = _pair(tiny_llama_path, rows=2)
    rng = np.random.default_rng(2)
    last = {}
    for row in (0, 1):
        prompt = rng.integers(3, 380, 50).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1]], last, steps=4)
    for engine in (compiled, eager):
        engine.release(0)
    prompt = rng.integers(3, 380, 10).tolist()  # shorter: positions 10..53 hold old keys
    last[0] = int(np.argmax(compiled.prefill(0, prompt)))
    eager.prefill(0, prompt)
    traces = compiled._fused.compiled.traces
    _run_steps(compiled, eager, [[0, 1], [0]], last, steps=6)
    assert compiled._fused.compiled.traces <= traces + 1  # [0] alone is a new row count


def test_a_step_on_another_thread_equals_the_first_threads(tiny_llama_path):
    """The split streams belong to a thread: a new driving thread gets its own graph."""
    compiled, eager = _pair(tiny_llama_path, rows=1)
    prompt = list(range(5, 25))
    compiled.prefill(0, prompt)
    eager.prefill(0, prompt)
    first = compiled.decode([0], [7])
    results = {}

    def drive():
        results["a"] = compiled.decode([0], [9])
        compiled.thread_exit()

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(first, eager.decode([0], [7]))
    np.testing.assert_array_equal(results["a"], eager.decode([0], [9]))


@pytest.mark.slow
def test_smollm2_compiled_greedy_equals_eager(default_model_path):
    """SmolLM2: 40 greedy steps on 2 rows at different cursors, across a SPAN boundary."""
    compiled, eager = _pair(default_model_path, rows=2)
    rng = np.random.default_rng(0)
    last = {}
    for row, n in enumerate((SPAN - 20, 7)):
        prompt = rng.integers(100, 40000, n).tolist()
        a, b = compiled.prefill(row, prompt), eager.prefill(row, prompt)
        np.testing.assert_array_equal(a, b)
        last[row] = int(np.argmax(a))
    _run_steps(compiled, eager, [[0, 1], [1]], last, steps=40)


def test_unsplit_steps_equal_eager(tiny_model_path):
    """Steps whose products are not split (BLIS threading, as without the thread setter) take
    the other attention form; the same result."""
    compiled, eager = _pair(tiny_model_path, rows=3)
    for engine in (compiled, eager):
        engine._split = lambda positions: False
    rng = np.random.default_rng(4)
    last = {}
    for row, n in enumerate((SPAN + 5, 9, 30)):
        prompt = rng.integers(3, 380, n).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1, 2], [2, 0]], last, steps=6)


def test_steps_without_a_rope_table_equal_eager(tiny_model_path):
    """Metal has no cos/sin table (its rope kernel is fast): the compiled step then rotates
    with the model's rope module at per-row offsets; the same result."""
    from llm_server.engines.compiled_step import CompiledSteps

    compiled, eager = _pair(tiny_model_path, rows=2)
    compiled._fused.table = eager._fused.table = None
    compiled._fused.compiled = CompiledSteps(compiled._fused)
    assert compiled._fused.compiled.rotation is None
    rng = np.random.default_rng(6)
    last = {}
    for row, n in enumerate((12, 70)):
        prompt = rng.integers(3, 380, n).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1], [1]], last, steps=4)
