"""Embeddings on other mlx-lm families: sliding windows, recurrent state, a `backbone` stack."""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.engines.contract import EmbeddingsUnsupported
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.pooling import EmbeddingConfig, Pooling
from llm_server.scheduler.embedder import Embedder
from llm_server.testing.families import build_family_checkpoint

LENGTHS = (3, 11, 20, 29)  # past the families' sliding window of 8


def embed(engine: MLXEngine, inputs: list[list[int]], mode: Pooling) -> np.ndarray:
    embedder = Embedder(EmbeddingConfig(mode, normalize=True))
    req = embedder.submit(inputs)
    while embedder.pending():
        embedder.run_batch(engine)
    return req.future.result(0)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "nemotron_h"])
def test_family_embeds_a_batch_as_each_input_alone(family, tmp_path):
    engine = MLXEngine(build_family_checkpoint(tmp_path / family, family))
    rng = np.random.default_rng(0)
    inputs = [[int(t) for t in rng.integers(0, 300, size=n)] for n in LENGTHS]
    for mode in (Pooling.MEAN, Pooling.LAST):
        batched = embed(engine, inputs, mode)
        alone = np.concatenate([embed(engine, [x], mode) for x in inputs])
        assert batched.shape == (len(inputs), 64)
        np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-5)
        assert len({v.tobytes() for v in batched}) == len(inputs)  # distinct inputs, vectors


def test_a_wrapper_without_hidden_states_is_refused(tmp_path):
    """llama4's stack is a nested language model that returns logits: refused (HTTP 400), not
    wrong."""
    engine = MLXEngine(build_family_checkpoint(tmp_path / "llama4", "llama4"))
    with pytest.raises(EmbeddingsUnsupported, match="does not return hidden states"):
        embed(engine, [[1, 2, 3]], Pooling.LAST)
