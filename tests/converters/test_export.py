"""MLX export round trip, the manifest/batching probe, and the llm-convert CLI's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from converters.cli import main
from converters.manifest import graph_info, read_manifest, supports_batching
from converters.mlx_export import export_mlx
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


def _logits(folder: Path, prompt: list[int]) -> np.ndarray:
    """All-position logits [q, vocab] float32 from mlx-lm loading `folder` directly."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(folder))
    out = model(mx.array([prompt]), cache=make_prompt_cache(model))
    return np.array(out[0].astype(mx.float32))


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def hf(request, tmp_path_factory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), TinySpec(arch=request.param)
    )


def test_mlx_round_trip_float32_is_exact(hf, tmp_path):
    out = export_mlx(hf, tmp_path / "mlx", rows=4, context_length=256, dtype="float32")
    np.testing.assert_allclose(_logits(out, PROMPT), _logits(hf, PROMPT), atol=1e-5, rtol=0)
    manifest = read_manifest(out)
    assert (manifest.backend, manifest.rows, manifest.context_length) == ("mlx", 4, 256)
    assert [i.name for i in manifest.inputs] == ["input_ids", "attn_mask", "position_ids"]
    assert manifest.inputs[1].shape == (4, 1, "q", 256)
    assert len(manifest.source_sha256) == 64
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()


def test_mlx_quantized_export_loads_and_stays_close(hf, tmp_path):
    out = export_mlx(hf, tmp_path / "q8", quantize=8)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    assert read_manifest(out).quantization_bits == 8
    got, want = _logits(out, PROMPT), _logits(hf, PROMPT)
    # 8-bit affine groups of 64: logits move by a few hundredths on this model.
    assert np.abs(got - want).max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def test_supports_batching_reads_the_manifest(hf, tmp_path):
    batched = export_mlx(hf, tmp_path / "b", rows=4)
    serial = export_mlx(hf, tmp_path / "s", rows=1)
    assert supports_batching(batched)
    assert not supports_batching(serial)
    # A plain HF folder is served by the MLX engine with dynamic masks.
    assert supports_batching(hf) and graph_info(hf).rows is None


def test_cli_exports_mlx_and_coreml(hf, tmp_path):
    assert main([str(hf), "--to", "mlx", "--out", str(tmp_path / "m"), "--rows", "2"]) == 0
    assert read_manifest(tmp_path / "m").rows == 2
    args = [
        str(hf),
        "--to",
        "coreml",
        "--out",
        str(tmp_path / "c"),
        "--rows",
        "1",
        "--context",
        "32",
    ]
    assert main(args) == 0
    assert not supports_batching(tmp_path / "c" / "model.mlpackage")


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        ("arch", ["--to", "mlx"], "unsupported architecture 'gpt2'"),
        ("none", ["--to", "coreml", "--rows", "0"], "--rows must be at least 1"),
        ("none", ["--to", "coreml", "--context", "999999"], "--context must be in"),
        ("none", ["--to", "coreml", "--quantize", "4"], "mlx only"),
        ("weights", ["--to", "mlx"], "no *.safetensors"),
    ],
)
def test_cli_errors_exit_2_with_one_line(hf, tmp_path, capsys, change, args, message):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf, src)
    if change == "arch":
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    if change == "weights":
        (src / "model.safetensors").unlink()
    assert main([str(src), *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_missing_source_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.gguf"), "--to", "mlx", "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
