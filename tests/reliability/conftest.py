"""Reliability fixtures: one live tiny-model server per module, and process helpers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest


@pytest.fixture(scope="module")
def server(tiny_model_path: Path):
    """A real uvicorn server on loopback serving the tiny model (2 rows, queue 16)."""
    from llm_server.testing.live import serving

    with serving(tiny_model_path, concurrent=2) as srv:
        yield srv


@pytest.fixture
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def assert_healthy(http: httpx.Client) -> dict:
    """/health is ok with every row free and the queue empty; returns the body."""
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["ready"] is True, body
    assert body["rows_busy"] == 0 and body["queue_length"] == 0, body
    return body


def assert_wait_healthy(http: httpx.Client, timeout: float = 30.0) -> dict:
    """Like assert_healthy, after cancelled requests have had `timeout` seconds to retire."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return assert_healthy(http)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
