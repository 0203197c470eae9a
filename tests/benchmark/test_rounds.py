"""llm-benchmark --rounds: every server runs several times at each concurrency, alternating, and
the comparison is the median of the round-by-round ratios (a shared machine's speed drifts by
more than the differences being measured: llama-server alone ranged over 37-42 tok/s at c1 in
one afternoon here)."""

from __future__ import annotations

import pytest

from llm_server.benchmark import report, summary, targets
from llm_server.benchmark.cli import build_parser, settings_from

TPS = "tokens_per_s"


def _run(tps: float) -> dict:
    return {"tokens_per_s": tps}


def _outs(*texts: str) -> list[dict]:
    return [{"text": t, "completion_tokens": len(t)} for t in texts]


def test_the_median_run_is_kept_with_every_rounds_rate():
    rounds = [
        (_run(30.0), _outs("a", "b")),
        (_run(10.0), _outs("a", "b")),
        (_run(20.0), _outs("a", "b")),
    ]
    run, outputs = summary.median_run(rounds)
    assert run["tokens_per_s"] == 20.0 and run["round"] == 3
    assert run["rounds_tokens_per_s"] == [30.0, 10.0, 20.0]  # in the order they ran
    assert run["same_outputs_every_round"] is True
    assert outputs == _outs("a", "b")


def test_an_even_count_keeps_the_lower_middle_run_and_flags_changed_outputs():
    rounds = [(_run(40.0), _outs("a")), (_run(10.0), _outs("a")), (_run(30.0), _outs("x")),
              (_run(20.0), _outs("a"))]  # fmt: skip
    run, _ = summary.median_run(rounds)
    assert run["tokens_per_s"] == 20.0 and run["round"] == 4
    assert run["same_outputs_every_round"] is False


def test_the_ratio_is_the_median_of_the_paired_rounds_not_of_the_medians():
    # the machine slowed down in round 2 for both servers: paired ratios see 1.1, 1.1, 0.8
    ours = {"tokens_per_s": 33.0, "rounds_tokens_per_s": [33.0, 22.0, 24.0]}
    theirs = {"tokens_per_s": 30.0, "rounds_tokens_per_s": [30.0, 20.0, 30.0]}
    assert summary.round_ratios(ours, theirs) == pytest.approx([1.1, 1.1, 0.8])
    assert summary.ratio(ours, theirs, TPS) == pytest.approx(1.1)
    # one round, or rounds that do not pair up: the plain ratio of the runs
    assert summary.ratio({"tokens_per_s": 33.0}, {"tokens_per_s": 30.0}, TPS) == pytest.approx(1.1)
    uneven = {"tokens_per_s": 30.0, "rounds_tokens_per_s": [30.0, 20.0]}
    assert summary.round_ratios(ours, uneven) is None
    assert summary.ratio(ours, uneven, TPS) == pytest.approx(1.1)
    assert summary.ratio(ours, {"tokens_per_s": 0.0}, TPS) is None
    # other keys are the kept runs' ratio, rounds or not
    slow = {**ours, "latency_p99_s": 3.0}
    assert summary.ratio(slow, {**theirs, "latency_p99_s": 2.0}, "latency_p99_s") == 1.5


def _report(rounds: int, ours: dict, peer: dict) -> dict:
    return {
        "meta": {
            "rounds": rounds,
            "peer": {"kind": "llama_server", "label": "llama-server", "command": "x"},
        },
        "servers": {"ours": {"1": ours}, "llama_server": {"1": peer}},
    }


def test_the_peer_target_and_the_report_use_the_paired_median():
    ours = {
        "tokens_per_s": 24.0,
        "rounds_tokens_per_s": [33.0, 22.0, 24.0],
        "same_outputs_every_round": True,
    }
    peer = {
        "tokens_per_s": 30.0,
        "rounds_tokens_per_s": [30.0, 20.0, 30.0],
        "same_outputs_every_round": False,
    }
    rep = _report(3, ours, peer)
    met = {t.id: t for t in targets._peer(rep)}
    assert met["peer_throughput_c1"].value == "1.10x" and met["peer_throughput_c1"].met is True
    table = "\n".join(report.rounds_table(rep, "llama_server"))
    assert "| 1 | 33.0, 22.0, 24.0 | 30.0, 20.0, 30.0 | 1.10, 1.10, 0.80 | 1.10x |" in table
    assert "Greedy outputs changed between rounds: llama_server at concurrency 1." in table
    assert report.rounds_table(_report(1, ours, peer), "llama_server") == []


def test_rounds_must_be_positive(tiny_model_path):
    args = build_parser().parse_args(["--model", str(tiny_model_path), "--rounds", "0"])
    with pytest.raises(SystemExit, match="--rounds must be 1 or more"):
        settings_from(args)
    ok = build_parser().parse_args(["--model", str(tiny_model_path), "--rounds", "3"])
    assert settings_from(ok).rounds == 3
