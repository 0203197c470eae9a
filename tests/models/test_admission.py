"""Header-only checkpoints of six models Mac users run (no weights: sparse files of their real
sizes) pass the checkpoint check, and the daemon admits each where a person could run it, at a
default context its rows hold within the budget (docs/models.md's table)."""

from __future__ import annotations

import pytest

from llm_server.benchmark.admission import BUDGETS, GiB, admissions
from llm_server.models.checkpoint import check_checkpoint
from llm_server.testing.header_checkpoints import CONFIGS, build


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("headers")


def test_header_only_checkpoints_have_real_sizes_and_no_weights(root):
    sizes = {}
    for name in CONFIGS:
        path = build(root, name)
        check_checkpoint(path)  # headers, file sizes and shapes agree with config.json
        files = list(path.glob("*.safetensors"))
        sizes[name] = sum(f.stat().st_size for f in files) / 1e9
        on_disk = sum(f.stat().st_blocks * 512 for f in files)
        assert on_disk < 16 << 20, name  # sparse: headers only
    # the published 4-bit conversions' sizes (GB), within 10%
    published = {
        "Llama-3.2-3B-Instruct-4bit": 1.81,
        "Qwen3-8B-4bit": 4.62,
        "gpt-oss-20b-4bit": 11.8,
        "Qwen3-Coder-30B-A3B-Instruct-4bit": 17.2,
    }
    for name, gb in published.items():
        assert abs(sizes[name] - gb) < gb / 10, (name, sizes[name])


def test_each_model_is_admitted_where_it_can_run_at_a_context_its_rows_hold(root):
    rows = admissions(root)
    refused = {(r.model, r.budget // GiB) for r in rows if not r.admitted}
    assert refused == {("Qwen3-Coder-30B-A3B-Instruct-4bit", 16)}  # 17.2 GB of weights
    for r in rows:
        if r.admitted:
            assert 256 <= r.size.context <= r.max_context
            assert r.size.needed <= r.budget
            # its rows at the default context fit beside its weights
            assert r.size.weights + r.size.kv * 4 // (4 + 8) <= r.budget or r.size.context == 256
    contexts = {(r.model, r.budget): r.size.context for r in rows}
    for name in CONFIGS:  # more memory, never a shorter context
        held = [contexts[(name, b)] for b in BUDGETS if (name, b) in contexts]
        assert held == sorted(held)
