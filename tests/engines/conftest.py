"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest

from llm_server.testing.families import build_family_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """family -> the tiny random checkpoint of that family (llm_server/testing/families.py),
    built once per session on first use. Tests that change a checkpoint copy it first."""
    root = tmp_path_factory.mktemp("families")
    built: dict = {}

    def get(family: str):
        if family not in built:
            built[family] = build_family_checkpoint(root / family, family)
        return built[family]

    return get
