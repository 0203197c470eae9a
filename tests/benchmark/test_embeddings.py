"""llm-benchmark --embeddings: a short run on the tiny checkpoint through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint


@pytest.mark.timeout(120)
def test_embeddings_benchmark_reports_three_modes(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "tiny-llama", TinySpec(arch="llama"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from llm_server.benchmark.cli import main; main()",
           "--embeddings", "--quick", "--concurrency", "2", "--embedding-inputs", "8",
           "--model", str(model), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "embeddings.json").read_text())
    assert [m["name"] for m in report["modes"]] == ["batched", "concurrent", "sequential"]
    assert [m["requests"] for m in report["modes"]] == [1, 8, 8]
    assert len(report["lengths"]) == 8 and min(report["lengths"]) == 20
    assert max(report["lengths"]) == 200
    for m in report["modes"]:
        assert m["inputs"] == 8 and m["tokens"] == sum(report["lengths"])
        assert m["inputs_per_s"] > 0 and m["tokens_per_s"] > 0
    assert report["max_abs_diff"] < 1e-5  # a batched vector equals the same input alone
    assert "| batched | 1 |" in proc.stdout and "inputs/s" in proc.stdout
