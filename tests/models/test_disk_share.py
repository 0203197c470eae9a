"""Under --models every model's prefix-cache disk tier lives in its own subfolder of
--prefix-cache-dir, and the one disk bound is split evenly over the models: a model over its
share deletes its own oldest files, never another model's."""

from __future__ import annotations

import httpx

from llm_server.models.daemon import model_folder
from llm_server.testing.managed import ManagedServer

from .test_on_demand import _complete

WORDS = [
    "red",
    "green",
    "blue",
    "cyan",
    "pink",
    "gray",
    "gold",
    "teal",
    "navy",
    "lime",
    "plum",
    "rust",
    "sand",
    "jade",
    "ruby",
]


def _files(folder) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.rglob("*.kv")}


def _long_prompt(seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(30))


def test_a_model_over_its_disk_share_never_deletes_another_models_files(entries, tmp_path):
    entries = entries[:2]  # alpha and beta: each gets half the bound
    bound = 240_000  # a prompt of ~100 tokens is ~50 KB of KV on disk: two fit in a share
    settings = {"prefix_cache_dir": tmp_path, "prefix_cache_disk_bytes": bound}
    with ManagedServer(entries, settings=settings) as srv:
        assert _complete(srv.url, "alpha", prompt=_long_prompt(0)).status_code == 200
        httpx.post(f"{srv.url}/v1/models/alpha/unload", timeout=60)  # resident entries written
        alpha = _files(tmp_path / "alpha")
        assert len(alpha) == 1
        for seed in range(1, 6):  # beta writes five files, over its share of 120 KB
            assert _complete(srv.url, "beta", prompt=_long_prompt(seed)).status_code == 200
        httpx.post(f"{srv.url}/v1/models/beta/unload", timeout=60)
        beta = _files(tmp_path / "beta")
        assert 1 <= len(beta) < 5  # beta deleted its own oldest files
        assert sum(beta.values()) <= bound // 2
        assert _files(tmp_path / "alpha") == alpha  # alpha's file survived
        assert sorted(p.name for p in tmp_path.iterdir()) == ["alpha", "beta"]


def test_model_folders_are_distinct_file_names():
    assert model_folder("smol") == "smol"
    hub = model_folder("HuggingFaceTB/SmolLM2-135M")
    assert "/" not in hub and hub.startswith("HuggingFaceTB_SmolLM2-135M-")
    assert model_folder("a/b") != model_folder("a_b")
    assert model_folder("..") not in ("..", "") and "/" not in model_folder("../x")
    assert model_folder("kv_model") != "kv_model"  # never read as a fingerprint's folder
