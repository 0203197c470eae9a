"""--log-requests: one line per request, streams aggregated, timings, no secrets, no lost line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from llm_server.api.shared.request_log import RequestRecorder
from replay.log import LOG_VERSION, LogEntry, read_log
from tests.replay.traffic import mixed_requests


def test_one_line_per_request_in_the_format(recording) -> None:
    lines = recording.path.read_text().splitlines()
    assert len(lines) == 20
    sent = mixed_requests()
    for line, (endpoint, body), (status, answer) in zip(
        lines, sent, recording.answers, strict=True
    ):
        obj = json.loads(line)
        assert set(obj) == {
            "v", "time", "endpoint", "stream", "request", "status", "response", "timings",
            "fingerprint",
        }  # fmt: skip
        assert obj["v"] == LOG_VERSION
        assert obj["endpoint"] == endpoint
        assert obj["request"] == body
        assert obj["status"] == status == 200
        assert obj["stream"] == bool(body.get("stream"))
        assert obj["fingerprint"] == recording.fingerprint
        assert obj["time"].endswith("Z")
        # The logged response is what the client read (streams aggregated the same way).
        assert obj["response"]["choices"] == answer["choices"]


def test_timings_come_from_the_scheduler(recording) -> None:
    log = read_log(recording.path)
    for entry in log.entries:
        t = entry.timings
        assert t.total is not None and t.total > 0
        scoring = entry.request.get("echo") and entry.request.get("logprobs") is not None
        if scoring:
            assert t.queue_wait is None and t.first_token is None
        else:
            assert 0 <= t.queue_wait <= t.first_token <= t.total


def test_streams_are_aggregated_with_finish_reason_and_usage(recording) -> None:
    log = read_log(recording.path)
    streams = [e for e in log.entries if e.stream]
    assert len(streams) == 5
    for entry in streams:
        body = entry.response
        assert body["object"] in ("chat.completion", "text_completion")
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        # usage is filled from the scheduler even when the stream did not ask for it
        assert body["usage"]["completion_tokens"] > 0
    chat_lp = next(e for e in streams if e.request.get("logprobs"))
    content = chat_lp.response["choices"][0]["message"]["content"]
    tokens = chat_lp.response["choices"][0]["logprobs"]["content"]
    assert len(tokens) == chat_lp.response["usage"]["completion_tokens"]
    assert content


def test_no_api_key_or_authorization_is_written(tiny_model_path, live_server, tmp_path) -> None:
    key = "sk-replay-secret-12345"
    path = tmp_path / "log.jsonl"
    recorder = RequestRecorder(path)
    srv = live_server(tiny_model_path, app_options={"api_key": key, "request_log": recorder})
    body = {"messages": [{"role": "user", "content": f"my key is {key}"}], "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        ok = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        refused = client.post("/v1/chat/completions", json=body)
    assert (ok.status_code, refused.status_code) == (200, 401)
    recorder.close()
    text = path.read_text()
    assert len(text.splitlines()) == 1  # the refused request never reached the handlers
    assert key not in text
    assert "authorization" not in text.lower() and "bearer" not in text.lower()
    assert json.loads(text)["request"]["messages"][0]["content"] == "my key is [redacted]"


def test_close_writes_every_queued_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    recorder = RequestRecorder(path)
    for i in range(2000):
        recorder.write(LogEntry("/v1/completions", {"prompt": str(i)}, {"choices": []}, 200))
    recorder.close()
    recorder.write(LogEntry("/v1/completions", {"prompt": "late"}, None, 499))  # after close
    entries = read_log(path).entries
    assert [e.request["prompt"] for e in entries] == [*map(str, range(2000)), "late"]
    assert [e.line for e in entries[:3]] == [1, 2, 3]
