"""Tiny vision-language checkpoints (mlx-vlm's classes, random weights), built once a session,
and no network: nothing a vision test runs may reach a hub."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'llm-server[vision]'")

from llm_server.testing.vision import (  # noqa: E402
    TEXT_ONLY_VLM_FAMILIES,
    VLM_FAMILIES,
    build_vlm_checkpoint,
)

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1, and a connection to any address off this machine fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    connect = socket.socket.connect

    def local_only(sock: socket.socket, address) -> None:
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            raise AssertionError(f"a vision test tried to reach {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


@pytest.fixture(scope="session")
def vlm_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    families = VLM_FAMILIES + TEXT_ONLY_VLM_FAMILIES
    return {family: build_vlm_checkpoint(root / family, family) for family in families}
