"""/v1/responses and /v1/messages share chat's admission and cancellation: a full server answers
429 before any stream byte (in each API's error format), and a dropped stream cancels."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.api.helpers import assert_openai_error

ASK = [{"role": "user", "content": "hi"}]
RESP = ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "temperature": 0})
MESS = ("/v1/messages", {"messages": ASK, "max_tokens": 3, "temperature": 0})


@pytest.fixture(scope="module")
def one_row(tiny_model_path, tmp_path_factory):
    """One row, no queue, a request log (its lines show when a handler has ended)."""
    from llm_server.api.shared.request_log import RequestRecorder
    from llm_server.testing.live import serving

    log = tmp_path_factory.mktemp("admission") / "log.jsonl"
    recorder = RequestRecorder(log)
    with serving(tiny_model_path, 1, 0, app_options={"request_log": recorder}) as srv:
        yield srv, log
    recorder.close()


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_429_before_any_byte(one_row):
    srv, _ = one_row
    sched = srv.service.scheduler
    steps = sched.stats().decode_steps
    lease = sched.acquire_lease(30)  # paused: the first request keeps the only slot
    first: dict = {}

    # EOS banned: its 2nd token always takes a decode step (a sampled EOS first, p ~ 1e-3 on
    # the tiny model, ends it at its prompt's forward with no decode step)
    no_eos = {str(t): -100 for t in srv.service.tokenizer.eos_token_ids}

    def hold() -> None:
        first["resp"] = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK,
                                   "max_tokens": 2, "logit_bias": no_eos}, timeout=60)  # fmt: skip

    t = threading.Thread(target=hold)
    try:
        t.start()
        _wait(lambda: sched.stats().queued + sched.stats().rows_busy >= 1, "never arrived")
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for path, body in (RESP, MESS):
                for stream in (False, True):
                    resp = c.post(path, json={**body, "stream": stream})
                    assert resp.status_code == 429, resp.text
                    assert resp.headers["content-type"] == "application/json"
                    assert int(resp.headers["retry-after"]) >= 1
                    if path == RESP[0]:
                        err = assert_openai_error(resp, 429)
                        assert err["code"] == "queue_full"
                    else:
                        assert resp.json()["error"]["type"] == "rate_limit_error"
    finally:
        lease.release()
        t.join(60)
    assert first["resp"].status_code == 200
    # (the counter the cancel test reads; it is bumped just after the step's tokens are sent,
    # so the response can arrive first)
    _wait(lambda: sched.stats().decode_steps > steps, "no decode step counted")


@pytest.mark.parametrize(("path", "body"), [RESP, MESS], ids=["responses", "messages"])
def test_a_dropped_stream_cancels(one_row, path, body):
    """Dropped while the scheduler is paused: the handler ends (its log line is written) and
    the request never decodes a token once the scheduler resumes."""
    srv, log = one_row
    sched = srv.service.scheduler
    lines = len(log.read_text().splitlines()) if log.exists() else 0
    steps = sched.stats().decode_steps
    lease = sched.acquire_lease(30)
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", path, json={**body, "stream": True}) as r,
        ):
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("event: ")
        _wait(lambda: len(log.read_text().splitlines()) > lines, "the handler never ended")
    finally:
        lease.release()
    _wait(lambda: sched.stats().queued + sched.stats().rows_busy == 0, "never idle")
    assert sched.stats().decode_steps == steps
    entry = json.loads(log.read_text().splitlines()[-1])
    assert entry["endpoint"] == path and entry["stream"] is True
