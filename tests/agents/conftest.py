"""The real coding agents against a live server: run by `make test-agents`, not `make test`.

They need npm (the pinned agents are installed into ~/.cache/llm-server/agents) and take
minutes, so they are collected only with LLM_SERVER_AGENT_TESTS=1, which the target sets.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_server.testing.agents import build_agent_checkpoint
from llm_server.testing.live import serving

collect_ignore_glob = [] if os.environ.get("LLM_SERVER_AGENT_TESTS") == "1" else ["test_*.py"]

AGENT_NAMES = ["codex", "claude-code", "qwen-code", "opencode"]
# One of each agent's own tools, read-only, that a forced first call runs.
FORCED_TOOL = {
    "codex": "exec_command",
    "claude-code": "Read",
    "qwen-code": "glob",
    "opencode": "read",  # its glob needs a ripgrep it downloads
}
STEP_TOKENS = 2048  # the agents' 10-20k-token prompts in fewer, larger forwards


@pytest.fixture(scope="session")
def agent_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 65,536-position Hermes checkpoint (llm_server/testing/agents.py)."""
    return build_agent_checkpoint(tmp_path_factory.mktemp("agents") / "agent-tiny")


@pytest.fixture(scope="session")
def agent_server(agent_model_path: Path):
    """A live server on the agents' checkpoint, shared by every test (and its prefix cache)."""
    with serving(agent_model_path, concurrent=2, step_tokens=STEP_TOKENS) as srv:
        yield srv
