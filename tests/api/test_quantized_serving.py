"""mlx-lm affine-quantized checkpoints (4/8-bit, groups 32/64/128, a per-layer mix) served over
HTTP at 4 rows: 4 staggered greedy requests return exactly what each returns alone, whether the
CPU dequantized them at load (the default) or serves them quantized (--keep-quantized)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import mlx.nn as nn
import numpy as np
import openai
import pytest

from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.testing.live import serving
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint
from llm_server.testing.tiny_quantized import quantize_checkpoint

PROMPTS = [
    "The capital of France is",
    "Hello, how are you today? I am",
    "def main():\n    print(",
    "One two three four five six",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    llama = build_tiny_checkpoint(root / "llama", TinySpec(arch="llama"))
    qwen3 = build_tiny_checkpoint(root / "qwen3")
    wide = build_tiny_checkpoint(  # group 128 needs inputs of 128 features
        root / "wide", TinySpec(arch="qwen3", hidden_size=128, intermediate_size=256)
    )
    return {
        "llama-4bit-g32": quantize_checkpoint(llama, root / "llama-q4g32", 4, 32),
        "qwen3-4bit-g64": quantize_checkpoint(qwen3, root / "qwen3-q4g64", 4, 64),
        "qwen3-mixed-4-8": quantize_checkpoint(qwen3, root / "qwen3-mixed", 4, 64, mixed=True),
        "qwen3-8bit-g128": quantize_checkpoint(wide, root / "wide-q8g128", 8, 128),
    }


def _complete(client: openai.OpenAI, model: str, prompt: str) -> tuple:
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    choice = r.choices[0]
    return tuple(choice.logprobs.tokens), choice.text, choice.finish_reason


def _alone_then_staggered(srv) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    model = srv.state.model_id
    alone = [_complete(client, model, p) for p in PROMPTS]
    assert all(tokens for tokens, _, _ in alone)
    # a round on a loaded machine may start its threads slower than a tiny model answers:
    # again (at most three rounds) until two requests shared a step
    for _ in range(3):
        got: list[tuple | None] = [None] * len(PROMPTS)

        def send(i: int, got=got) -> None:
            got[i] = _complete(client, model, PROMPTS[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
            time.sleep(0.005)  # staggered arrivals: rows at different cursors
        for t in threads:
            t.join(120)
        for i, (g, a) in enumerate(zip(got, alone, strict=True)):
            assert g == a, f"request {i} batched differs from alone"
        if srv.service.scheduler.stats().max_rows_busy >= 2:
            break
    assert srv.service.scheduler.stats().max_rows_busy >= 2  # it really batched


@pytest.mark.parametrize(
    "name", ["llama-4bit-g32", "qwen3-4bit-g64", "qwen3-mixed-4-8", "qwen3-8bit-g128"]
)
def test_dequantized_on_cpu_batches_like_serial(checkpoints, name, caplog):
    with (
        caplog.at_level(logging.INFO, logger="llm_server.engines.mlx.quantized"),
        serving(checkpoints[name], concurrent=4) as srv,
    ):
        engine = srv.service.engine
        assert engine.quantized is False and engine.fused is not None  # the fast path
        assert not any(_quantized(engine))
        _alone_then_staggered(srv)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "to float32" in lines[0]


@pytest.mark.parametrize("name", ["llama-4bit-g32", "qwen3-mixed-4-8"])
def test_keep_quantized_batches_like_serial(checkpoints, name):
    with serving(checkpoints[name], concurrent=4, keep_quantized=True) as srv:
        engine = srv.service.engine
        assert engine.quantized is True and engine.fused is None  # mlx-lm's quantized forward
        assert any(_quantized(engine))
        _alone_then_staggered(srv)


def test_dequantized_logits_match_quantized_forward(checkpoints):
    """Dequantizing changes the arithmetic, not the model: logits agree with mlx-lm's
    quantized products to float32 rounding (and the mixed config's 8-bit layers are 8-bit)."""
    path = checkpoints["qwen3-mixed-4-8"]
    kept = MLXEngine(path, EngineSettings(rows=1, keep_quantized=True))
    bits = {n: m.bits for n, m in _named_quantized(kept)}
    assert bits["model.layers.0.self_attn.v_proj"] == 8 and bits["lm_head"] == 8
    assert bits["model.layers.0.self_attn.q_proj"] == 4
    deq = MLXEngine(path, EngineSettings(rows=1))
    prompt = [5, 17, 42, 99, 3, 250]
    np.testing.assert_allclose(deq.prefill(0, prompt), kept.prefill(0, prompt), atol=1e-4)
    np.testing.assert_allclose(deq.decode([0], [7]), kept.decode([0], [7]), atol=1e-4)


def _named_quantized(engine) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in engine.model.named_modules() if isinstance(m, nn.QuantizedLinear)]


def _quantized(engine) -> list[nn.Module]:
    return [m for _, m in _named_quantized(engine)]


def test_kept_quantized_with_a_warning_when_float32_does_not_fit(checkpoints, monkeypatch, caplog):
    from llm_server.engines.mlx import quantized

    monkeypatch.setattr(quantized, "available_memory", lambda: 1 << 10)  # 1 KiB free
    with caplog.at_level(logging.WARNING, logger="llm_server.engines.mlx.quantized"):
        engine = MLXEngine(checkpoints["qwen3-4bit-g64"], EngineSettings(rows=2))
    assert engine.quantized is True and engine.fused is None and any(_quantized(engine))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("kept 16 quantized layers (4-bit affine, group 64) quantized")
    logits = engine.prefill(0, [5, 6, 7])
    assert logits.shape == (engine.vocab_size,) and np.isfinite(logits).all()
