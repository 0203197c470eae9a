"""What one `llm-benchmark` run measures: the settings the CLI resolves and the runner reads;
and the parser the one-off probes (`python -m llm_server.benchmark.<probe>`) start from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    model: Path
    out: Path
    quick: bool
    concurrencies: list[int]
    requests: int
    max_tokens: int
    scoring_prompts: int
    mlx_lm: bool
    scoring: bool
    constrained: bool
    prefix_cache: bool = False
    step_tokens: int | None = None  # our server's --step-tokens (None: its default)
    workload: str = "chat"  # "chat": prompts.json; "edit": one-change passages; "agent": agent.py
    speculative: str | None = None  # our server's --speculative (None: its default)
    peer: str | None = None  # report kind of a peer server (cli.PEERS), started from peer_cmd
    peer_cmd: str | None = None
    rounds: int = 1  # runs of each server at each concurrency, servers alternating (median kept)
    peers: tuple[tuple[str, str], ...] = ()  # every (kind, command); the agent workload runs all
    agent_log: str = "codex"  # agent workload: agent_conversation.LOGS name or a JSON path
    agent_turns: int = 5
    agent_conversations: int = 1
    page_poll: bool = False  # also run ours with a client polling as the open page does


def probe_parser(probe: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m llm_server.benchmark.<probe>`, with its --model option."""
    p = argparse.ArgumentParser(prog=f"python -m llm_server.benchmark.{probe}", description=doc)
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    return p
