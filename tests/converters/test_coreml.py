"""Core ML export checked on Linux: the saved package, run by the numpy MIL interpreter through the
Core ML engine's row logic, must match mlx-lm on the same checkpoint; one perturbed weight must not.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from converters.coreml_export import export_coreml
from converters.manifest import read_manifest, read_package_spec, supports_batching
from converters.mil_interp import MilInterpreter
from llm_server.engines.coreml.engine import RowDriver
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

ROWS, CONTEXT = 4, 64
DECODE_STEPS = 8
# fp16 weights, activations and KV cache vs mlx float32: logits are O(1..10); measured max
# |diff| is 0.013 (qwen3) and 0.023 (llama), so 0.08 absolute leaves margin; a perturbed
# weight lands far above it.
ATOL = 0.08
PROMPTS = ([5, 17, 42, 7, 99], list(range(3, 23)), [11, 12, 13], list(range(40, 49)))


def _reference(src: Path, prompt: list[int], fed: list[int]) -> np.ndarray:
    """mlx-lm logits for `prompt`'s last position, then after each of `fed` [1 + len(fed), vocab]."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(src))
    cache = make_prompt_cache(model)
    out = [np.array(model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32))]
    for token in fed:
        out.append(np.array(model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)))
    return np.stack(out)


def _run_package(package: Path, skip: tuple[int, int]) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill each row alone, then decode 8 steps; row skip[0] sits out step skip[1].

    Tokens fed are the package's own greedy picks, so both sides see identical inputs.
    Returns per-row logits [1 + steps fed, vocab] and the tokens fed per row.
    """
    interp = MilInterpreter(package)
    manifest = read_manifest(package.parent)
    driver = RowDriver(
        ROWS, CONTEXT, manifest.q_sizes, lambda inputs, _: interp.predict(inputs)["logits"]
    )
    logits = [[driver.prefill(row, prompt)] for row, prompt in enumerate(PROMPTS)]
    fed: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(DECODE_STEPS):
        rows = [r for r in range(ROWS) if (r, step) != skip]
        tokens = [int(np.argmax(logits[r][-1])) for r in rows]
        for r, token, row_logits in zip(rows, tokens, driver.decode(rows, tokens), strict=True):
            fed[r].append(token)
            logits[r].append(row_logits)
    return [np.stack(rows) for rows in logits], fed


def _max_error(src: Path, package: Path) -> tuple[float, bool]:
    got, fed = _run_package(package, skip=(2, 3))
    worst, argmax_equal = 0.0, True
    for row, prompt in enumerate(PROMPTS):
        want = _reference(src, prompt, fed[row])
        worst = max(worst, float(np.abs(got[row] - want).max()))
        argmax_equal &= bool((got[row].argmax(-1) == want.argmax(-1)).all())
    return worst, argmax_equal


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def exported(request, tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp(request.param)
    src = build_tiny_checkpoint(base / "hf", TinySpec(arch=request.param))
    return src, export_coreml(src, base / "coreml", rows=ROWS, context_length=CONTEXT)


def test_interpreter_matches_mlx_with_rows_at_different_cursors(exported):
    src, package = exported
    worst, argmax_equal = _max_error(src, package)
    assert worst <= ATOL, f"max |logit diff| {worst:.4f} > {ATOL}"
    assert argmax_equal


def test_one_perturbed_weight_fails_the_check(exported, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = exported
    bad_src = tmp_path / "bad"
    shutil.copytree(src, bad_src)
    weights = load_file(str(bad_src / "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.weight"
    weights[name] = weights[name] + 0.05 * np.random.default_rng(1).standard_normal(
        weights[name].shape
    ).astype(np.float32)
    save_file(weights, str(bad_src / "model.safetensors"))
    bad_package = export_coreml(bad_src, tmp_path / "coreml", rows=ROWS, context_length=CONTEXT)
    worst, _ = _max_error(src, bad_package)
    assert worst > ATOL, f"perturbed package still within tolerance ({worst:.4f})"


def test_package_interface_and_batching_probe(exported, tmp_path):
    src, package = exported
    spec = read_package_spec(package)
    assert [i.name for i in spec.description.input] == ["input_ids", "attn_mask", "position_ids"]
    assert [o.name for o in spec.description.output] == ["logits"]
    assert "llm_manifest" in spec.description.metadata.userDefined
    assert (package.parent / "tokenizer.json").is_file()
    assert supports_batching(package) and supports_batching(package.parent)
    serial = export_coreml(src, tmp_path / "serial", rows=1, context_length=32)
    assert not supports_batching(serial)


def test_graph_without_attn_mask_does_not_batch(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec((4, 8), dtype=types.int32)], opset_version=ct.target.iOS18
    )
    def prog(input_ids):
        return mb.cast(x=input_ids, dtype="fp32", name="logits")

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        skip_model_load=True,
    )
    model.save(str(tmp_path / "plain.mlpackage"))
    assert not supports_batching(tmp_path / "plain.mlpackage")


def _coreml_unavailable() -> str | None:
    """Why MLModel.predict cannot run the export here (not macOS 15+), or None."""
    from llm_server.engines.coreml.engine import require_macos_15

    try:
        require_macos_15()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_coreml_unavailable() is not None, reason=str(_coreml_unavailable()))
def test_coreml_engine_matches_interpreter(exported):
    from llm_server.engines.coreml.engine import CoreMLEngine

    src, package = exported
    engine = CoreMLEngine(package)
    want = _reference(src, PROMPTS[1], [])[0]
    got = engine.prefill(1, PROMPTS[1])
    assert np.abs(got - want).max() <= ATOL
    assert engine.cursor(1) == len(PROMPTS[1])


def test_coreml_engine_refuses_linux():
    if sys.platform == "darwin":
        pytest.skip("checks the non-macOS error")
    from llm_server.engines.coreml.engine import CoreMLEngine

    with pytest.raises(RuntimeError, match="macOS"):
        CoreMLEngine("anything")
