"""What one `llm-benchmark` run measures: the settings the CLI resolves and the runner reads."""

from __future__ import annotations

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
    workload: str = "chat"  # "chat": prompts.json; "edit": reproduce a passage with one change
    speculative: str | None = None  # our server's --speculative (None: its default)
    peer: str | None = None  # report kind of a peer server (cli.PEERS), started from peer_cmd
    peer_cmd: str | None = None
