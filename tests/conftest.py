"""Shared fixtures: tiny checkpoints built once per session, the real default model, servers."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint (random float32 weights, real BPE tokenizer, ChatML)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: Path):
    """The tiny checkpoint's tokenizer through the server's own wrapper."""
    from llm_server.tokenizer import Tokenizer

    return Tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", TinySpec(arch="llama")
    )


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into the user cache."""
    from llm_server.default_model import default_model_path as resolve

    return resolve()


@pytest.fixture
def make_service():
    """Factory for started services; every one is closed at teardown."""
    from llm_server.testing.live import tiny_service

    made = []

    def make(model_path: Path, concurrent: int = 1, max_queued: int = 16, **kw):
        svc = tiny_service(model_path, concurrent, max_queued, **kw)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.scheduler.abort()
        svc.close(30)


@pytest.fixture
def live_server():
    """Factory: a real uvicorn server on loopback for a model; stopped at teardown."""
    from llm_server.testing.live import serving

    with contextlib.ExitStack() as stack:

        def start(
            model_path: Path, concurrent: int = 1, max_queued: int = 16, app_options=None, **kw
        ):
            return stack.enter_context(
                serving(model_path, concurrent, max_queued, app_options, **kw)
            )

        yield start
