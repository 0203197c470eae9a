"""API test fixtures: one shared live server per module (model loading dominates test time)."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from llm_server.testing.tiny import HERMES_TEMPLATE, THINKING_TEMPLATE, build_tiny_checkpoint


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


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    """The tiny model with a Hermes tool-call template (8 concurrent rows)."""
    from llm_server.testing.live import serving

    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("hermes") / "tiny-hermes", chat_template=HERMES_TEMPLATE
    )
    with serving(path, concurrent=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    """The tiny model with a Qwen3-style `<think>` template (serial)."""
    from llm_server.testing.live import serving

    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("think") / "tiny-think", chat_template=THINKING_TEMPLATE
    )
    with serving(path) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(hermes_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(hermes_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=hermes_server.url, api_key="unused", max_retries=0)
