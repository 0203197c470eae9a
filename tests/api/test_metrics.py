"""/metrics: Prometheus text that parses, with counters that move after requests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(http) -> dict[tuple[str, tuple], float]:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_requests_tokens_and_steps(http):
    before = scrape(http)
    ok = ("llm_server_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))
    bad = ("llm_server_requests_total", (("route", "/v1/chat/completions"), ("status", "400")))
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    http.get("/no/such/route")
    after = scrape(http)
    assert after[ok] == before.get(ok, 0) + 1
    assert after[bad] == before.get(bad, 0) + 1
    unmatched = ("llm_server_requests_total", (("route", "unmatched"), ("status", "404")))
    assert after[unmatched] >= 1
    tokens = ("llm_server_tokens_generated_total", ())
    assert after[tokens] == before.get(tokens, 0) + r.json()["usage"]["completion_tokens"]
    steps = ("llm_server_step_seconds_count", ())
    # The first token comes from prefill; the rest from decode steps.
    assert after[steps] >= before.get(steps, 0) + r.json()["usage"]["completion_tokens"] - 1
    assert after[("llm_server_rows_busy", ())] == 0
    assert after[("llm_server_queue_length", ())] == 0
    assert after[("llm_server_rows", ())] == 1
    assert after[("llm_server_ready", ())] == 1
