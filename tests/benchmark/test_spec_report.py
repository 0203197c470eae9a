"""llm-benchmark's per-run speculation counts, read from our server's /health (issue 38)."""

from __future__ import annotations

from llm_server.benchmark import spec_report


def test_a_run_reports_the_draft_ids_verified_and_kept_during_its_load(
    live_server, tiny_model_path
):
    url = live_server(tiny_model_path, concurrent=2).url
    before = spec_report.snapshot(url)
    assert before is not None and before["mode"] in ("ngram", "off")
    after = {**before, "drafted_tokens": before["drafted_tokens"] + 12}
    after["accepted_tokens"] = before["accepted_tokens"] + 3
    assert spec_report.delta(before, after) == {
        "speculative": before["mode"],
        "drafted_tokens": 12,
        "accepted_tokens": 3,
        "draft_acceptance": 0.25,
        "spec_cost_model": before["cost_model"],  # /health's fit, carried into the run's row
    }
    assert set(before["cost_model"]) == {"fit_ms", "sources"}
    assert spec_report.delta(before, None) == {}
    assert spec_report.snapshot("http://127.0.0.1:9") is None  # nothing listens: no crash
