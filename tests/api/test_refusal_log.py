"""Operators see refusals: one info line per 4xx on every route (route, status, field, message),
whichever layer answered it; none for answers that are not refusals."""

from __future__ import annotations

import logging

import httpx
import pytest

LOGGER = "llm_server.api.shared.errors"


@pytest.fixture
def refusals(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize(
    ("method", "path", "body", "line"),
    [
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 9},
            "refused POST /v1/chat/completions -> 400 param=temperature: 'temperature' must be",
        ),
        (
            "POST",
            "/v1/responses",
            {"input": "hi", "max_output_tokens": "many"},
            "refused POST /v1/responses -> 400 param=max_output_tokens: ",
        ),
        (
            "POST",
            "/v1/messages",
            {"messages": [{"role": "user", "content": "hi"}]},
            "refused POST /v1/messages -> 400 param=max_tokens: ",
        ),
        ("POST", "/v1/completions", {"prompt": "hi", "n": 0}, "-> 400 param=n: "),
        (
            "GET",
            "/v1/nowhere",
            None,
            "refused GET /v1/nowhere -> 404 param=-: no route /v1/nowhere",
        ),
        ("GET", "/v1/chat/completions", None, "refused GET /v1/chat/completions -> 405 param=-: "),
    ],
)
def test_one_line_per_refusal(server, refusals, method, path, body, line):
    resp = httpx.request(method, server.url + path, json=body, timeout=30)
    assert 400 <= resp.status_code < 500, resp.text
    (logged,) = _lines(refusals)
    assert line in logged and logged.startswith("refused ")
    assert refusals.records[-1].levelno == logging.INFO


def test_the_api_key_check_is_logged_and_answers_are_not(tiny_model_path, live_server, refusals):
    srv = live_server(tiny_model_path, app_options={"api_key": "sesame"})
    ok = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers={"Authorization": "Bearer sesame"},
        timeout=30,
    )
    assert ok.status_code == 200 and _lines(refusals) == []
    denied = httpx.get(srv.url + "/v1/models", timeout=30)
    assert denied.status_code == 401
    (logged,) = _lines(refusals)
    assert logged.startswith("refused GET /v1/models -> 401 param=-: ")
