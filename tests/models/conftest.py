"""Three tiny checkpoints (different architectures and seeds) registered together."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_server.models.registry import ModelEntry
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

SPECS = {
    "alpha": TinySpec(arch="qwen3", seed=1),
    "beta": TinySpec(arch="llama", seed=2),
    "gamma": TinySpec(arch="qwen2", seed=3),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """id -> checkpoint folder, for three different tiny models."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture
def entries(tiny_models: dict[str, Path]) -> list[ModelEntry]:
    return [ModelEntry(id=name, source=str(path)) for name, path in tiny_models.items()]
