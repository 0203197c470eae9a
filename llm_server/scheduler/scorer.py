"""Scoring (`/v1/completions` echo+logprobs) in padded batches between decode steps (C1-C4).

STUB: being implemented (issue 5). The data shapes below are the contract with the API layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoredPrompt:
    """Log-probabilities of one prompt (plus an optional greedy next token)."""

    tokens: list[int]  # prompt ids, then the generated token when one was asked for
    token_logprobs: list[float | None]  # per token; the first entry is None
    top_logprobs: list[list[tuple[int, float]] | None]  # per token, best first; first is None
    generated: int | None  # the greedy next token id (max_tokens 1), else None
