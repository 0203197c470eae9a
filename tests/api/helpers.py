"""Assertions shared by the API tests."""

from __future__ import annotations

import httpx


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    """`resp` has `status` and the OpenAI error body; returns the inner error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in resp.text
    if param is not None:
        assert err["param"] == param
    return err
