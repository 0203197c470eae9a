"""The one message between the scheduler and the engine: a step plan, and what running it gave.

The scheduler's `plan()` (scheduler/planner.py) decides a step; `engine.run(plan)` executes the
forward part of it; the scheduler's commit samples, emits and retires. Like vLLM v1's
`SchedulerOutput`, the plan is plain data: rows, token ids and ranges, never model state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llm_server.engines.base import Engine


@dataclass(frozen=True)
class DecodeRow:
    """A running row that advances one token this step."""

    row: int  # engine row
    token: int  # the input id: the row's last sampled token, written at the row's cursor
    # speculative tokens would ride here later (draft ids verified in the same forward)
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillChunk:
    """A piece of a prompt to run on its row this step."""

    seq: int  # the request's id (GenerationRequest.seq)
    row: int  # engine row the prompt lives in
    prompt: Sequence[int]  # the whole prompt; the chunk is prompt[start:end]
    start: int  # first position to run: the row's cursor (0: a fresh row, see below)
    end: int  # one past the last position to run; == len(prompt) on the last chunk
    # start == 0 opens the row: the engine resets it and may reuse a cached prefix of the
    # prompt (prefix cache, or a running row holding the same prefix); it then runs at most
    # end - start positions from the reused length, never past the prompt.

    @property
    def fresh(self) -> bool:
        return self.start == 0

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Admission:
    """A queued request that takes a free row at this step."""

    seq: int  # the request's id
    row: int  # the free row it takes (lowest first)
    exclusive: bool  # run alone to completion before the step's forward (lease mode)


@dataclass(frozen=True)
class StepPlan:
    """Everything one scheduler step does, decided before any of it runs."""

    retire: tuple[int, ...] = ()  # rows of cancelled requests, freed before the forward (S5)
    drop: tuple[int, ...] = ()  # seqs of cancelled queued requests, finished unserved (S5)
    admit: tuple[Admission, ...] = ()  # FIFO queue heads taking free rows (S2, S3)
    decode: tuple[DecodeRow, ...] = ()  # rows advancing one token, in row order (S2)
    prefill: tuple[PrefillChunk, ...] = ()  # prompt chunks, in admission order
    score: bool = False  # the scorer runs one padded batch after the forward (C1)
    budget: int = 0  # the step-token budget it was planned under (0: unlimited)

    @property
    def tokens(self) -> int:
        """Positions the forward runs: one per decode row plus each chunk's length."""
        return len(self.decode) + sum(c.tokens for c in self.prefill)

    @property
    def decode_rows(self) -> tuple[int, ...]:
        return tuple(d.row for d in self.decode)

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        return tuple(c.row for c in self.prefill)

    @property
    def forward(self) -> bool:
        """Whether `engine.run` has anything to do."""
        return bool(self.decode or self.prefill)


@dataclass(frozen=True)
class StepResult:
    """What `engine.run(plan)` returns: the logits to sample from, and where rows stand."""

    rows: tuple[int, ...]  # rows with a token to sample: decode rows, then finished prompts
    logits: np.ndarray  # [len(rows), vocab] float32: each row's last-position logits
    cursors: Mapping[int, int] = field(default_factory=dict)  # chunk row -> its new cursor
    cached: Mapping[int, int] = field(default_factory=dict)  # fresh row -> prefix tokens reused


def run_by_primitives(engine: Engine, plan: StepPlan) -> StepResult:
    """Execute `plan` with `prefill` and `decode` alone, for engines without a mixed forward
    (Core ML): one decode forward, then each chunk's prompt prefilled whole on a fresh row
    (such engines cannot resume a prompt, so a chunk there always completes its prompt)."""
    rows: list[int] = []
    parts: list[np.ndarray] = []
    cursors: dict[int, int] = {}
    cached: dict[int, int] = {}
    if plan.decode:
        rows += [d.row for d in plan.decode]
        parts.append(engine.decode(rows, [d.token for d in plan.decode]))
    for chunk in plan.prefill:
        if not chunk.fresh:
            raise ValueError(f"{engine.name} cannot resume a prompt at position {chunk.start}")
        parts.append(engine.prefill(chunk.row, chunk.prompt)[None])
        rows.append(chunk.row)
        cursors[chunk.row] = len(chunk.prompt)
        cached[chunk.row] = engine.cached_tokens(chunk.row)
    logits = np.concatenate(parts) if parts else np.zeros((0, engine.vocab_size), np.float32)
    return StepResult(tuple(rows), logits, cursors, cached)
