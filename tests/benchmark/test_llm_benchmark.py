"""llm-benchmark: a --quick run on the tiny checkpoint, and the target arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_server.benchmark import targets
from llm_server.benchmark.cli import build_parser, settings_from
from llm_server.benchmark.roofline import weight_bytes
from llm_server.benchmark.scoring import scoring_prompts
from llm_server.testing.tiny import build_tiny_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    """One `llm-benchmark --quick` on a freshly built tiny checkpoint (both servers)."""
    root = tmp_path_factory.mktemp("bench")
    model = build_tiny_checkpoint(root / "tiny-qwen3")
    out = root / "out"
    cmd = [sys.executable, "-c", "from llm_server.benchmark.cli import main; main()",
           "--quick", "--model", str(model), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# llm-benchmark: tiny-qwen3" in proc.stdout  # the Markdown is printed too
    return json.loads((out / "benchmark.json").read_text()), out, model


@pytest.mark.timeout(240)
def test_quick_run_measures_both_servers(quick_run):
    report, _, _ = quick_run
    assert report["meta"]["quick"] is True
    assert report["meta"]["concurrencies"] == [1, 2]
    assert report["failures"] == []
    for kind in ("ours", "mlx_lm"):
        assert sorted(report["servers"][kind]) == ["1", "2"]
        for c, run in report["servers"][kind].items():
            outs = report["outputs"][kind][c]
            assert run["requests"] == run["ok_requests"] == 4 == len(outs)
            assert run["errors"] == []
            assert run["token_sources"] == ["usage"]
            assert run["completion_tokens"] == sum(o["completion_tokens"] for o in outs)
            assert run["tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["wall_s"])
            for o in outs:  # a request stops at its limit exactly when it ran out of tokens
                assert (o["finish_reason"] == "length") == (o["completion_tokens"] == 8), o
                assert 1 <= o["completion_tokens"] <= 8
                assert 0 < o["ttft_s"] <= o["latency_s"]
            assert run["rss_peak_bytes"] >= run["rss_warm_bytes"] > 10_000_000
    # S10: greedy float32 output does not depend on the batch.
    assert report["identity"]["ours"] == {
        "identical": True,
        "reference_concurrency": 1,
        "differing": {"2": []},
    }


@pytest.mark.timeout(240)
def test_quick_run_scoring_roofline_and_files(quick_run):
    report, out, model = quick_run
    scoring = report["scoring"]
    assert scoring["status"] == "ok", scoring
    assert sorted(scoring["lengths"]) == [20, 80, 140, 200]
    assert scoring["server_concurrency"] == 2
    assert scoring["max_abs_logprob_diff"] < 1e-3  # C4: padded scores equal scoring alone
    roof = report["roofline"]
    from safetensors.numpy import load_file

    expected = sum(a.nbytes for a in load_file(str(model / "model.safetensors")).values())
    assert roof["weight_bytes"] == expected == weight_bytes(model)
    assert roof["single_stream_tokens_per_s"] == report["servers"]["ours"]["1"]["tokens_per_s"]
    by_id = {t["id"]: t for t in report["targets"]}
    assert by_id["throughput_c4"]["met"] is None  # concurrency 4 was not run
    assert by_id["greedy_identical"]["met"] is True
    md = (out / "benchmark.md").read_text()
    assert "| concurrency | tok/s ours | tok/s mlx_lm | ours/mlx_lm |" in md
    assert "| greedy outputs identical across concurrencies (ours) | identical | met |" in md
    assert (out / "benchmark.png").read_bytes()[:8] == PNG_MAGIC
    for name in ("ours-c1", "ours-c2", "mlx_lm-c1", "mlx_lm-c2"):
        assert (out / "logs" / f"{name}.log").is_file()
        pid = report["meta"]["commands"][name]["pid"]
        with pytest.raises(ProcessLookupError):  # every server was stopped
            os.kill(pid, 0)


def _run(tps: float, p99: float = 1.0, peak: int = 100, warm: int = 100, after: int = 100) -> dict:
    return {"tokens_per_s": tps, "latency_p99_s": p99, "ttft_p99_s": p99 / 10, "rss_peak_bytes": peak,
            "rss_after_over_warm": after / warm}  # fmt: skip


def test_quick_run_reports_inter_token_gaps_and_the_engine_rate(quick_run):
    report, out, _ = quick_run
    for c, run in report["servers"]["ours"].items():
        assert run["itl_p50_ms"] > 0 and run["itl_p99_ms"] >= run["itl_p50_ms"]
        assert run["engine_step_ms"] > 0
        assert run["engine_tokens_per_s"] == pytest.approx(int(c) * 1000 / run["engine_step_ms"])
        assert run["served_over_engine"] == pytest.approx(
            run["tokens_per_s"] / run["engine_tokens_per_s"]
        )
    assert (
        "mlx_lm" not in report["servers"]
        or "engine_step_ms" not in report["servers"]["mlx_lm"]["1"]
    )
    md = (out / "benchmark.md").read_text()
    assert "| concurrency | ITL p50 ms | ITL p99 ms |" in md


def test_targets_are_judged_exactly():
    report = {
        "servers": {
            "ours": {"1": _run(16.0), "4": _run(48.0, after=116), "8": _run(81.0, p99=2.0)},
            "mlx_lm": {"1": _run(16.0), "4": _run(40.0), "8": _run(65.0, p99=1.9, peak=90)},
        },
        "roofline": {"single_stream_fraction": 0.40},
        "scoring": {"status": "ok", "speedup": 2.99},
        "identity": {"ours": {"identical": False}},
    }
    met = {t["id"]: t["met"] for t in targets.evaluate(report)}
    assert met == {
        "throughput_c1": True,  # 1.00x >= 1.00
        "throughput_c4": False,  # 1.20x < 1.25
        "throughput_c8": False,  # 1.246x < 1.25
        "scaling_c4_c1": True,  # exactly 3x
        "itl_tail": None,  # no inter-token gaps or engine rate in this report
        "engine_share": None,
        "latency_p99": False,  # c8 is slower
        "ttft_p99": False,
        "rss_peak": False,  # c8 peak above theirs
        "rss_return": False,  # c4 came back 16% above warm-up
        "roofline": True,
        "scoring": False,
        "greedy_identical": False,
    }


def test_step_targets_judge_the_highest_concurrency():
    low, top = _run(16.0), _run(80.0)
    low.update(concurrency=1, itl_p99_over_p50=3.0, served_over_engine=0.5)
    top.update(concurrency=8, itl_p99_over_p50=1.5, served_over_engine=0.79)
    met = {t["id"]: t["met"] for t in targets.evaluate({"servers": {"ours": {"1": low, "8": top}}})}
    assert met["itl_tail"] is True and met["engine_share"] is False  # 1.5 <= 1.5; 79% < 80%


def test_targets_without_mlx_lm_are_not_judged():
    report = {
        "servers": {"ours": {"1": _run(10.0), "4": _run(31.0)}},
        "scoring": {"status": "unavailable"},
    }
    met = {t["id"]: t["met"] for t in targets.evaluate(report)}
    assert met["throughput_c1"] is None and met["latency_p99"] is None and met["rss_peak"] is None
    assert met["scaling_c4_c1"] is True and met["rss_return"] is True
    assert met["scoring"] is None and met["roofline"] is None and met["greedy_identical"] is None


def test_scoring_prompts_have_exact_spread_lengths():
    prompts = scoring_prompts(
        ["one two three four five six seven"], lambda t: list(range(len(t.split()))), 32
    )
    assert sorted(len(p) for p in prompts) == sorted(round(20 + 180 * i / 31) for i in range(32))
    assert min(len(p) for p in prompts) == 20 and max(len(p) for p in prompts) == 200


@pytest.mark.parametrize(
    "flag", [["--concurrency", "0,2"], ["--concurrency", "a"], ["--requests", "0"]]
)
def test_bad_settings_exit_with_a_message(flag, tiny_model_path):
    args = build_parser().parse_args(["--model", str(tiny_model_path), *flag])
    with pytest.raises(SystemExit, match="llm-benchmark: "):
        settings_from(args)


def test_prefix_cache_benchmark_on_tiny_model(tiny_model_path, tmp_path):
    """Multi-turn TTFT with the cache on and off: same outputs, later turns reuse history."""
    from llm_server.benchmark import prefix

    report = prefix.run(tiny_model_path, tmp_path, chats=2, turns=3, max_tokens=4)
    assert report["outputs_identical"] is True
    first, *later = report["turns_table"]
    for row in later:
        assert row["cached_tokens_mean"] > first["prompt_tokens_mean"] / 2
        assert row["ttft_on_s"] > 0 and row["ttft_off_s"] > 0
    md = (tmp_path / "prefix.md").read_text()
    assert "| 3 |" in md and "identical with the cache on and off: True" in md
