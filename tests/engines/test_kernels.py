"""The kernel set (engines/forward/kernels.py): chosen once at load, each set takes its own branches,
and the two sets agree on what a user sees.

Exactness per set: under linux_cpu a row's logits do not depend on batching, mixing or
compiling, bit for bit (the rest of tests/engines); under generic the same suites run again
(`make test-generic`). Between the two sets logits differ by rounding only: the generic set
runs MLX's own attention, rope and SiLU where linux_cpu runs the CPU decode attention, a
cos/sin table and numpy's sigmoid and softmax, so the two sum the same terms in other orders.
Measured on the tiny checkpoints (prefill of 90/130 tokens, 8 decode steps): qwen3 and llama
5.7e-6 apart with logits up to ~16, gemma3_text (mlx-lm's forward) 4.4e-5 with logits up to
~30, i.e. 1.5e-6 of the largest logit; RELATIVE_TOLERANCE leaves ~7x room. Greedy tokens equal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.forward import kernels
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.native import mlx_lm_patches, skinny
from llm_server.testing.families import build_family_checkpoint

ON_CPU = mx.default_device() == mx.cpu
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="the linux_cpu set needs MLX on the CPU")
RELATIVE_TOLERANCE = 1e-5  # of the largest |logit|: float32 sums in other orders (see above)


def test_the_set_comes_from_the_argument_the_environment_or_the_device():
    assert kernels.resolve(env={}).name == ("linux_cpu" if ON_CPU else "generic")
    assert kernels.resolve(env={kernels.ENV: "generic"}).name == "generic"
    assert kernels.resolve(env={kernels.ENV: " Generic "}).name == "generic"
    assert kernels.resolve("generic", env={kernels.ENV: "linux_cpu"}).name == "generic"
    with pytest.raises(ValueError, match="LLM_SERVER_KERNELS must be one of linux_cpu, generic"):
        kernels.resolve(env={kernels.ENV: "metal"})
    with pytest.raises(ValueError, match="kernels must be one of linux_cpu, generic, got 'fast'"):
        kernels.resolve("fast", env={})


def test_linux_cpu_is_refused_off_the_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "default_name", lambda: kernels.GENERIC)
    monkeypatch.setattr(kernels.mx, "default_device", lambda: "gpu")
    with pytest.raises(ValueError, match="linux_cpu kernel set needs MLX on the CPU"):
        kernels.resolve("linux_cpu", env={})


def test_the_environment_reaches_the_engine(tiny_model_path, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "generic")
    assert MLXEngine(tiny_model_path, EngineSettings(rows=1)).kernels.name == "generic"
    with pytest.raises(ValueError, match="kernels must be one of"):
        MLXEngine(tiny_model_path, EngineSettings(rows=1, kernels="numpy"))


@needs_cpu
def test_each_set_takes_its_own_branches(tiny_model_path):
    cpu = MLXEngine(tiny_model_path, EngineSettings(rows=2, kernels="linux_cpu"))
    generic = MLXEngine(tiny_model_path, EngineSettings(rows=2, kernels="generic"))
    assert cpu.fused.table is not None and cpu.fused.compiled is not None
    assert not cpu.pipelined
    # generic: mlx-lm's rope, eager decode steps, MLX attention, pipelined greedy steps
    assert generic.fused.table is None and generic.fused.compiled is None
    assert isinstance(generic.fused.k, kernels.GenericFused) and generic.pipelined  # no ops
    assert generic.forward.context(1).key is None and generic.forward.context(8).key is None
    unfused = MLXEngine(
        tiny_model_path, EngineSettings(rows=2, kernels="generic", fused_decode=False)
    )
    layer = unfused.model.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "Linear"  # no SplitLinear


def _greedy_logits(engine: MLXEngine, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """Prefill each prompt on its row, then `steps` batched greedy decode steps."""
    out = [np.stack([engine.prefill(r, p) for r, p in enumerate(prompts)])]
    rows = list(range(len(prompts)))
    for _ in range(steps):
        out.append(engine.decode(rows, [int(t) for t in out[-1].argmax(-1)]))
    return out


@needs_cpu
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_both_sets_give_the_same_tokens_and_logits_to_rounding(family, tmp_path):
    """qwen3 runs the fused forward, gemma3_text (sliding windows) mlx-lm's with the CPU
    set's numpy attention patched in: prompts long enough for the numpy paths (>= 32k
    scores), two rows, eight decode steps."""
    path = build_family_checkpoint(tmp_path / family, family)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (90, 130)]
    cpu = _greedy_logits(MLXEngine(path, EngineSettings(rows=2, kernels="linux_cpu")), prompts, 8)
    generic = _greedy_logits(MLXEngine(path, EngineSettings(rows=2, kernels="generic")), prompts, 8)
    for a, b in zip(cpu, generic, strict=True):
        assert np.array_equal(a.argmax(-1), b.argmax(-1))
        assert np.abs(a - b).max() <= RELATIVE_TOLERANCE * np.abs(a).max()


@needs_cpu
def test_a_generic_engine_loaded_after_a_cpu_one_runs_mlx_lms_attention(tmp_path):
    """mlx-lm's model module is shared by a family: the engine loaded last sets its patches,
    so a generic engine gets MLX's attention whatever was loaded before it, bit for bit."""
    path = build_family_checkpoint(tmp_path / "gemma", "gemma3_text")
    prompt = np.random.default_rng(1).integers(3, 300, 200).tolist()  # 4 x 200 x 200 scores
    fresh = MLXEngine(path, EngineSettings(rows=1, kernels="generic")).prefill(0, prompt)
    MLXEngine(path, EngineSettings(rows=1, kernels="linux_cpu")).prefill(0, prompt)
    module = type(MLXEngine(path, EngineSettings(rows=1, kernels="generic")).model).__module__
    assert mlx_lm_patches._INSTALLED[module] is False
    again = MLXEngine(path, EngineSettings(rows=1, kernels="generic")).prefill(0, prompt)
    assert np.array_equal(fresh, again)


def test_health_reports_the_engines_set(tiny_model_path, live_server, monkeypatch):
    import httpx

    monkeypatch.setenv(kernels.ENV, "generic")
    srv = live_server(tiny_model_path)
    health = httpx.get(f"{srv.url}/health").json()
    assert health["kernels"] == "generic" and health["ready"] is True


def test_generic_compiled_steps_equal_its_eager_steps(tmp_path):
    """The generic set's compiled step (MLX's fused attention over the read span; off by
    default, as on Metal until shown there) gives the eager generic steps' logits: two rows at
    different cursors, eight steps. Bit for bit where the skinny library runs the products
    (make test here); with BLIS alone (LLM_SERVER_SKINNY=0) the compiled step's 2-D products
    sum in another order, measured up to 5.7e-6 with logits up to ~16 (RELATIVE_TOLERANCE), and
    on Metal it is not shown yet."""
    path = build_family_checkpoint(tmp_path / "qwen3", "qwen3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (90, 130)]
    compiled = MLXEngine(path, EngineSettings(rows=2, kernels="generic", compiled_decode=True))
    got = _greedy_logits(compiled, prompts, 8)
    want = _greedy_logits(MLXEngine(path, EngineSettings(rows=2, kernels="generic")), prompts, 8)
    assert compiled.fused.compiled.traces >= 1
    exact = ON_CPU and skinny.loaded()
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.argmax(-1), b.argmax(-1))
        if exact:
            assert np.array_equal(a, b)
        else:
            assert np.abs(a - b).max() <= RELATIVE_TOLERANCE * np.abs(b).max()
