"""benchmark.turns: the table's floor columns and a real run of ours on every API."""

from __future__ import annotations

import json

import pytest

from llm_server.benchmark.turns import main, markdown


def test_the_table_divides_each_ratio_by_its_turns_floor():
    first = {"api": "chat", "turn": 1, "prompt": 3700, "cached": 0, "ttft_s": 9.0}
    later = [
        {"api": "chat", "turn": 2, "prompt": 3720, "cached": 3700, "new": 20, "ttft_s": 0.33,
         "alone_s": 0.1, "reuse": 1.0, "ratio": 3.3, "floor": 2.2},
        {"api": "chat", "turn": 3, "prompt": 3740, "cached": 3720, "new": 20, "ttft_s": 0.25,
         "alone_s": 0.1, "reuse": 1.0, "ratio": 2.5, "floor": 2.0},
    ]  # fmt: skip
    text = markdown({"turns": 3, "max_tokens": 16, "server_rows": 4, "rows": [first, *later]})
    assert "| chat | 1 | 3700 | 0 | | 9.000 | | | | |" in text
    assert (
        "| chat | 2 | 3720 | 3700 | 1.000 | 0.330 | 0.100 (20 tok) | 3.30 | 2.20 | 1.50 |" in text
    )
    assert (
        "| chat | 3 | 3740 | 3720 | 1.000 | 0.250 | 0.100 (20 tok) | 2.50 | 2.00 | 1.25 |" in text
    )
    assert "Turns 2+ (4 server rows)" in text
    assert "over the floor median 1.38, max 1.50 (target <= 1.3)" in text
    unknown = [{k: v for k, v in r.items() if k != "floor"} for r in later]  # not llama-shaped
    text = markdown({"turns": 3, "max_tokens": 16, "server_rows": 1, "rows": [first, *unknown]})
    assert "| chat | 2 | 3720 | 3700 | 1.000 | 0.330 | 0.100 (20 tok) | 3.30 | - | - |" in text
    assert "no floor (the config is not llama-shaped) (target <= 1.3)" in text


@pytest.mark.timeout(300)
def test_a_run_reuses_each_previous_prompt_on_every_api(tiny_model_path, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_path), "--out", str(out), "--system-tokens", "200",
            "--turns", "2", "--max-tokens", "4", "--repeats", "1", "--settle", "0.2"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "turns.json").read_text())
    assert report["server_rows"] == 4
    rows = report["rows"]
    apis = ("chat", "responses", "responses-stateless", "messages")
    assert [(r["api"], r["turn"]) for r in rows] == [(a, t) for a in apis for t in (1, 2)]
    for r in rows[1::2]:  # every second turn takes its whole previous prompt from the cache
        assert r["reuse"] >= 0.95 and r["floor"] > 1.0 and r["alone_s"] > 0
    assert "over the floor median" in (out / "turns.md").read_text()
