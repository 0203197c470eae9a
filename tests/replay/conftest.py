"""Replay fixtures: the mixed traffic recorded once per session through --log-requests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.replay.traffic import send_all


@dataclass(frozen=True)
class Recording:
    path: Path  # the request log
    answers: list[tuple[int, dict]]  # (status, body) as the client saw them, streams aggregated
    fingerprint: str


@pytest.fixture(scope="session")
def recording(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """20 mixed requests sent to a serial live server that logs requests."""
    from llm_server.api.shared.request_log import RequestRecorder
    from llm_server.testing.live import LiveServer, tiny_service

    path = tmp_path_factory.mktemp("replay") / "requests.jsonl"
    recorder = RequestRecorder(path)
    svc = tiny_service(tiny_model_path)
    try:
        with LiveServer(svc, request_log=recorder) as srv:
            answers = send_all(srv.url)
    finally:
        svc.close(30)
        recorder.close()
    return Recording(path, answers, svc.fingerprint)
