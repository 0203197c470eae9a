"""--log-requests records /v1/embeddings; replay reproduces the vectors (within float32 rounding,
float and base64), and a vector that moved fails --check."""

from __future__ import annotations

import asyncio
import json

import httpx

from llm_server.api.app import AppState, create_app
from replay import cli
from replay.compare import compare
from replay.log import read_log
from replay.runner import replay_app

TEXTS = ["The capital of France", "Hello, how are you today?", "Paris"]


def test_embeddings_are_logged_and_replayed(tiny_model_path, make_service, tmp_path):
    from llm_server.api.shared.request_log import RequestRecorder
    from llm_server.testing.live import LiveServer

    path = tmp_path / "embeddings.jsonl"
    recorder = RequestRecorder(path)
    svc = make_service(tiny_model_path, concurrent=4)
    try:
        with LiveServer(svc, request_log=recorder) as srv, httpx.Client(base_url=srv.url) as http:
            for fmt in ("float", "base64"):
                body = {"input": TEXTS, "encoding_format": fmt}
                assert http.post("/v1/embeddings", json=body).status_code == 200
            assert http.post("/v1/embeddings", json={"input": ""}).status_code == 400
    finally:
        recorder.close()
    log = read_log(path)
    assert [e.endpoint for e in log.entries] == ["/v1/embeddings"] * 3
    assert [e.status for e in log.entries] == [200, 200, 400]

    for concurrent in (False, True):
        app = create_app(AppState(svc, svc.config.model_id))
        report = asyncio.run(replay_app(app, log, concurrent=concurrent))
        assert [r.status for r in report.results] == [200, 200, 400], report.summary()
        assert all(r.identical for r in report.results), report.summary()
        assert not report.failed_check

    with LiveServer(svc) as fresh:
        assert cli.main([str(path), "--url", fresh.url, "--check"]) == 0

    logged = log.entries[0].response
    moved = json.loads(json.dumps(logged))
    moved["data"][1]["embedding"][5] += 1e-2
    diff = compare("/v1/embeddings", 200, logged, 200, moved)
    assert diff is not None and diff.field == "data[1].embedding" and diff.position == 5
