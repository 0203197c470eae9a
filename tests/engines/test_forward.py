"""The one forward (FusedForward.run) and the kernel sets behind it: every fused step is that
function, and the Linux-CPU set lives with the native code, which never imports the engines."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.forward.fused import FusedForward
from llm_server.engines.forward.kernels import GenericKernels, MLXAttention
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.mlx.layout import output_head
from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan
from llm_server.engines.settings import EngineSettings
from llm_server.native import mlx_lm_patches
from llm_server.native.cpu_set import LinuxCPUKernels
from llm_server.testing.families import build_family_checkpoint

NATIVE = Path(__file__).resolve().parents[2] / "llm_server" / "native"


def test_the_native_code_never_imports_the_engines():
    imports = []
    for path in sorted(NATIVE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imports += [(path.name, node.module)]
            elif isinstance(node, ast.Import):
                imports += [(path.name, alias.name) for alias in node.names]
    assert any(module == "llm_server.native" for _, module in imports)  # the walk sees imports
    assert [i for i in imports if i[1].startswith("llm_server.engines")] == []


@pytest.mark.parametrize("kernels", ["linux_cpu", "generic"])
def test_decode_mixed_and_scoring_steps_all_run_the_one_forward(
    kernels, tiny_model_path, monkeypatch
):
    """A compiled decode step (traced), an eager decode step, a mixed step with a draft and
    a prompt chunk, and a scoring
    session's chunk each call FusedForward.run once (a prefill too), with the engine's set's functions."""
    if kernels == "linux_cpu" and mx.default_device() != mx.cpu:
        pytest.skip("the linux_cpu set needs MLX on the CPU")
    calls: list[tuple[int, bool]] = []
    run = FusedForward.run

    def counted(self, groups, context):
        calls.append((len(groups), all(g.q == 1 for g in groups)))
        return run(self, groups, context)

    monkeypatch.setattr(FusedForward, "run", counted)
    compiled = MLXEngine(
        tiny_model_path, EngineSettings(rows=3, kernels=kernels, compiled_decode=True)
    )
    assert compiled.fused.kernels.name == kernels
    assert isinstance(compiled.kernels.functions, GenericKernels) == (kernels == "generic")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    for row, prompt in enumerate(prompts):
        compiled.prefill(row, prompt)
    assert calls == [(1, False), (1, False)]  # a prompt: one group of its positions
    calls.clear()
    first = compiled.decode([0, 1], [12, 13])  # traced: run inside mx.compile
    assert calls == [(1, True)]
    compiled.decode([0, 1], [14, 15])  # replayed: no Python forward
    assert calls == [(1, True)]

    eager = MLXEngine(
        tiny_model_path, EngineSettings(rows=3, kernels=kernels, compiled_decode=False)
    )
    for row, prompt in enumerate(prompts):
        eager.prefill(row, prompt)
    calls.clear()
    again = eager.decode([0, 1], [12, 13])
    assert calls == [(1, True)]
    if kernels == "linux_cpu":  # the compiled step is the eager forward, bit for bit
        assert np.array_equal(first, again)

    calls.clear()  # two decoding rows (one with a draft) and a chunk: one forward, three groups
    eager.run(
        StepPlan(
            decode=(DecodeRow(0, 14), DecodeRow(1, 15, draft=(16, 17))),
            prefill=(PrefillChunk(1, 2, [20, 21, 22, 23, 24], 0, 5),),
        )
    )
    assert calls == [(3, False)]

    calls.clear()
    eager.score_begin(1)
    eager.score_chunk(np.array([[3, 4, 5, 6]]), np.array([[4, 5, 6, 7]]), 2)
    assert calls == [(1, False)]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the linux_cpu set needs the CPU")
def test_each_set_patches_and_heads_mlx_lms_forward(tmp_path):
    """For families outside the fused layers: the CPU set turns the family's numpy paths on
    and the generic set off again (one module per family, shared); both heads give the same
    logits bit for bit (a split product sums each output as the whole one does)."""
    path = build_family_checkpoint(tmp_path / "gemma", "gemma3_text")
    model = MLXEngine(path, EngineSettings(rows=1, kernels="generic")).model
    module = type(model).__module__
    cpu, generic = LinuxCPUKernels(MLXAttention), GenericKernels()
    cpu.prepare_mlx_lm(model, False)
    assert mlx_lm_patches._INSTALLED[module] is True
    generic.prepare_mlx_lm(model, False)
    assert mlx_lm_patches._INSTALLED[module] is False
    layer, tied = output_head(model)
    hidden = mx.random.normal((1, 1, layer.weight.shape[1]), key=mx.random.key(3))
    want = np.array(generic.mlx_lm_head(layer, tied, hidden))
    assert want.shape[-1] == layer.weight.shape[0] and np.abs(want).max() > 0
    assert np.array_equal(np.array(cpu.mlx_lm_head(layer, tied, hidden)), want)
