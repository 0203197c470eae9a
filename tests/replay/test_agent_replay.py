"""--log-requests records /v1/responses and /v1/messages; replay reproduces them (a chained
`previous_response_id` names the replayed response), in-process and with llm-replay --check."""

from __future__ import annotations

import asyncio

import httpx

from llm_server.api.app import AppState, create_app
from replay import cli
from replay.log import read_log
from replay.runner import replay_app

ASK = [{"role": "user", "content": "Name a city."}]


def _traffic(url: str) -> list[str]:
    """Responses (plain, streamed, chained), Messages (plain, streamed), count_tokens."""
    with httpx.Client(base_url=url, timeout=60) as http:
        first = http.post(
            "/v1/responses", json={"input": "Hi", "max_output_tokens": 6, "temperature": 0}
        ).json()
        chained = {"previous_response_id": first["id"], "input": "More.", "temperature": 0}
        bodies = [
            ("/v1/responses", {**chained, "max_output_tokens": 5}),
            ("/v1/responses", {"input": ASK, "max_output_tokens": 5, "temperature": 0, "stream": True}),
            ("/v1/messages", {"messages": ASK, "max_tokens": 6, "temperature": 0}),
            ("/v1/messages", {"messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True}),
            ("/v1/messages/count_tokens", {"messages": ASK}),
            ("/v1/messages", {"messages": ASK}),  # 400: max_tokens is required
        ]  # fmt: skip
        statuses = [http.post(path, json=body).status_code for path, body in bodies]
    assert statuses == [200, 200, 200, 200, 200, 400]
    return [first["id"]]


def test_agent_endpoints_are_logged_and_replayed(tiny_model_path, make_service, tmp_path):
    from llm_server.api.shared.request_log import RequestRecorder
    from llm_server.testing.live import LiveServer

    path = tmp_path / "agents.jsonl"
    recorder = RequestRecorder(path)
    svc = make_service(tiny_model_path, concurrent=4)
    try:
        with LiveServer(svc, request_log=recorder) as srv:
            _traffic(srv.url)
    finally:
        recorder.close()
    log = read_log(path)
    endpoints = [e.endpoint for e in log.entries]
    assert endpoints == ["/v1/responses"] * 3 + ["/v1/messages"] * 2 + [
        "/v1/messages/count_tokens",
        "/v1/messages",
    ]
    streamed = log.entries[2]
    assert streamed.stream and streamed.response["status"] in ("completed", "incomplete")
    assert streamed.response["output"][0]["content"][0]["text"]
    message = log.entries[4]
    assert message.stream and message.response["content"][0]["type"] == "text"
    assert message.response["usage"]["output_tokens"] == 6
    assert log.entries[6].status == 400 and log.entries[6].response["type"] == "error"

    for concurrent in (False, True):  # a fresh app: its store is empty, ids are new
        app = create_app(AppState(svc, svc.config.model_id))
        report = asyncio.run(replay_app(app, log, concurrent=concurrent))
        assert [r.status for r in report.results] == [200] * 6 + [400], report.summary()
        assert all(r.identical for r in report.results), report.summary()
        assert not report.failed_check

    with LiveServer(svc) as fresh:
        assert cli.main([str(path), "--url", fresh.url, "--check"]) == 0
