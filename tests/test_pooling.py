"""Pooling settings read from sentence-transformers files, and chunked pooling over padding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_server.pooling import (
    EmbeddingConfigError,
    PoolAccumulator,
    Pooling,
    load_embedding_config,
    truncate,
)
from llm_server.testing.embedding import add_sentence_transformers_files


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "model_type": "llama"}))
    return tmp_path


def test_no_sentence_transformers_files_means_last_token_l2(folder):
    cfg = load_embedding_config(folder)
    assert (cfg.pooling, cfg.normalize, cfg.prompts, cfg.size) == (Pooling.LAST, True, {}, 8)
    assert load_embedding_config(folder, "mean").pooling is Pooling.MEAN


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_and_normalize_come_from_the_modules(folder, mode, normalize):
    prompts = {"query": "Instruct: find passages\nQuery:", "document": ""}
    add_sentence_transformers_files(folder, mode, normalize, prompts)
    cfg = load_embedding_config(folder)
    assert (cfg.pooling, cfg.normalize, cfg.prompts) == (Pooling(mode), normalize, prompts)
    assert cfg.source == "sentence-transformers"
    assert load_embedding_config(folder, "cls").pooling is Pooling.CLS  # --pooling wins


def test_modules_that_cannot_be_served_are_refused(folder):
    add_sentence_transformers_files(folder, "mean")
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(EmbeddingConfigError, match="3_Dense"):
        load_embedding_config(folder)

    (folder / "modules.json").write_text(json.dumps(modules))
    pool_file = folder / "1_Pooling" / "config.json"
    pool = json.loads(pool_file.read_text())
    pool_file.write_text(
        json.dumps({**pool, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True})
    )
    with pytest.raises(EmbeddingConfigError, match="pooling_mode_max_tokens"):
        load_embedding_config(folder)
    pool_file.write_text(json.dumps({**pool, "include_prompt": False}))
    with pytest.raises(EmbeddingConfigError, match="include_prompt"):
        load_embedding_config(folder)


@pytest.mark.parametrize("mode", list(Pooling))
def test_chunked_pooling_reads_real_positions_only(mode):
    rng = np.random.default_rng(0)
    lengths = [1, 5, 9, 12]
    hidden = rng.standard_normal((4, 12, 6)).astype(np.float32)
    for r, n in enumerate(lengths):
        hidden[r, n:] = np.nan  # padding: any read of it would poison the vector
    acc = PoolAccumulator(mode, lengths)
    for lo, hi in [(0, 4), (4, 8), (8, 12)]:
        acc.add(hidden[:, lo:hi])
    got = acc.finish(normalize=True)
    for r, n in enumerate(lengths):
        real = hidden[r, :n].astype(np.float64)
        want = {Pooling.LAST: real[-1], Pooling.MEAN: real.mean(0), Pooling.CLS: real[0]}[mode]
        np.testing.assert_allclose(got[r], want / np.linalg.norm(want), rtol=0, atol=1e-6)


def test_truncate_renormalises():
    v = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    np.testing.assert_allclose(truncate(v, 2), [0.6, 0.8], atol=1e-7)
    assert truncate(v, None) is v
