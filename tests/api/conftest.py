"""API test fixtures: one shared live server per module (model loading dominates test time)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest


@pytest.fixture(scope="module")
def server(tiny_model_path: Path):
    """A real uvicorn server on loopback serving the tiny model (serial, queue 16)."""
    from llm_server.testing.live import serving

    with serving(tiny_model_path) as srv:
        yield srv


@pytest.fixture
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
