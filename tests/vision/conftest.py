"""Tiny vision-language checkpoints (mlx-vlm's classes, random weights), built once a session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a hub
pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'llm-server[vision]'")

from llm_server.testing.vision import VLM_FAMILIES, build_vlm_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def vlm_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: build_vlm_checkpoint(root / family, family) for family in VLM_FAMILIES}
