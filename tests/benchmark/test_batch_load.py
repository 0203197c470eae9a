"""llm_server/benchmark/batch_load.py: its batch file is a valid batch for the server, and its
report renders (the measurement itself runs in `llm-benchmark --batch`)."""

from __future__ import annotations

import json

from llm_server.batch.lines import parse_input
from llm_server.benchmark.batch_load import batch_file, markdown
from llm_server.benchmark.runner import load_prompts


def test_the_batch_file_parses_into_greedy_chat_lines():
    lines = parse_input(batch_file(load_prompts(), 40, 16), "/v1/chat/completions")
    assert len(lines) == 40 and all(line.error is None for line in lines)
    assert len({line.custom_id for line in lines}) == 40
    assert all(line.body["max_tokens"] == 16 and line.body["temperature"] == 0.0 for line in lines)


def test_the_report_renders_each_concurrency_and_both_throughputs():
    side = {"request_tokens_per_s_p50": 20.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2}
    report = {
        "lines": 500,
        "rows": 8,
        "server_args": [],
        "interactive": {
            1: [
                {
                    "alone": side,
                    "with_batch": {**side, "request_tokens_per_s_p50": 19.0},
                    "batch_lines_meanwhile": 3,
                    "batch_ran_throughout": True,
                }
            ],  # fmt: skip
        },
        "batch_idle": {"seconds": 100.0, "lines_per_s": 5.0, "tokens_per_s": 160.0},
        "ordinary_c8": {"seconds": 110.0, "lines_per_s": 4.5, "tokens_per_s": 150.0},
    }
    text = markdown(json.loads(json.dumps(report)))
    assert "| 1 | 20.0 | 19.0 | -5.0% | 100 ms | 100 ms | 200 ms | 200 ms | 3 |" in text
    assert "| as a batch, idle server | 100.0 | 5.00 | 160.0 |" in text
