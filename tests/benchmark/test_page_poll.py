"""llm-benchmark --page-poll: our server runs the load again with a client polling what the page
at / polls, once a second (the page's overhead, issue 46)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from llm_server.benchmark.page_poll import polling
from llm_server.testing.tiny import build_tiny_checkpoint


def test_the_poller_fetches_the_page_then_polls_its_state(live_server, tiny_model_path):
    srv = live_server(tiny_model_path)
    with polling(srv.url, interval=0.05) as count:
        while count.polls < 3:
            httpx.get(srv.url + "/health")
    assert count.failed == 0


def test_a_run_with_the_page_polling_is_reported_beside_the_plain_one(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "tiny-qwen3")
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from llm_server.benchmark.cli import main; main()",
           "--quick", "--model", str(model), "--out", str(out), "--no-mlx-lm", "--concurrency", "1",
           "--scoring-prompts", "0", "--page-poll", "--requests", "8", "--max-tokens", "64"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "benchmark.json").read_text())
    assert report["failures"] == []
    assert sorted(report["meta"]["commands"]) == ["ours-c1", "ours_page-c1"]
    page = report["servers"]["ours_page"]["1"]
    assert page["ok_requests"] == 8 and page["page_polls_failed"] == 0
    # the same server: the same greedy text with the page open or closed
    texts = {name: [o["text"] for o in report["outputs"][name]["1"]] for name in report["outputs"]}
    assert texts["ours_page"] == texts["ours"]
    md = (out / "benchmark.md").read_text()
    assert "## The page open (cells: page closed / page polling)" in md
