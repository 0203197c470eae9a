"""The one message between the scheduler and the engine: a step plan, and what running it gave.

The scheduler's `plan()` (scheduler/planner.py) decides a step; `engine.run(plan)` executes the
forward part of it; the scheduler's commit samples, emits and retires. Like vLLM v1's
`SchedulerOutput`, the plan is plain data: rows, token ids and ranges, never model state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DecodeRow:
    """A running row that advances one token this step."""

    row: int  # engine row
    token: int  # the input id: the row's last sampled token, written at the row's cursor
    # drafted ids verified in the same forward (speculative decoding, scheduler/drafting.py):
    # the row runs token + draft as its query and gets logits at every one of those positions
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
class ScoreChunk:
    """A piece of a scoring prompt to run on one of the engine's scoring rows this step (C3).

    The engine runs it as one more row group of the step's forward, with logits at every
    position, and reduces them to log-probabilities before the step returns (never held).
    """

    key: int  # the scorer's id of the prompt (stable across the prompt's chunks)
    row: int  # engine scoring row (`Engine.score_rows`: rows after the serving rows)
    prompt: Sequence[int]  # the whole prompt; the chunk is prompt[start:end]
    start: int  # first position to run: the row's cursor (0: the row is reset first)
    end: int  # one past the last position; position i is scored against prompt[i + 1]
    top_k: int  # top-k entries per position the reduction keeps (0: none)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def targets(self) -> list[int]:
        """The id whose log-probability each position gets: the next prompt token (the last
        position repeats the last token, C4: it is read only for the greedy next token)."""
        nxt = list(self.prompt[self.start + 1 : self.end + 1])
        return nxt + [self.prompt[-1]] * (self.tokens - len(nxt))


@dataclass(frozen=True)
class ScoreChunkResult:
    """Log-probabilities of one scoring chunk, reduced on the engine before the next chunk."""

    token_logprobs: np.ndarray  # [N, q] float32: log p(target[n, i] | prefix up to i)
    top_ids: np.ndarray  # [N, q, k] int32: top-k token ids per position (k may be 0)
    top_logprobs: np.ndarray  # [N, q, k] float32
    greedy_ids: np.ndarray  # [N, q] int32: argmax token per position


@dataclass(frozen=True)
class Admission:
    """A queued request that takes a free row at this step."""

    seq: int  # the request's id
    row: int  # the free row it takes (lowest first)
    exclusive: bool  # run alone before the forward (--constrained-mode exclusive)


@dataclass(frozen=True)
class StepPlan:
    """Everything one scheduler step does, decided before any of it runs."""

    retire: tuple[int, ...] = ()  # rows of cancelled requests, freed before the forward (S5)
    drop: tuple[int, ...] = ()  # seqs of cancelled queued requests, finished unserved (S5)
    admit: tuple[Admission, ...] = ()  # FIFO queue heads taking free rows (S2, S3)
    decode: tuple[DecodeRow, ...] = ()  # rows advancing one token, in row order (S2)
    prefill: tuple[PrefillChunk, ...] = ()  # prompt chunks, in admission order
    score: tuple[ScoreChunk, ...] = ()  # scoring chunks on the engine's scoring rows (C1, C3)
    pump: bool = False  # a pump (embeddings, the session scorer) runs one batch after it
    budget: int = 0  # the step-token budget it was planned under (0: unlimited)

    @property
    def tokens(self) -> int:
        """Positions the forward runs: one per decode row (plus its draft) and each prompt
        and scoring chunk's length."""
        return (
            sum(1 + len(d.draft) for d in self.decode)
            + sum(c.tokens for c in self.prefill)
            + sum(c.tokens for c in self.score)
        )

    @property
    def decode_rows(self) -> tuple[int, ...]:
        return tuple(d.row for d in self.decode)

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        return tuple(c.row for c in self.prefill)

    @property
    def forward(self) -> bool:
        """Whether `engine.run` has anything to do."""
        return bool(self.decode or self.prefill or self.score)


@dataclass(frozen=True)
class StepResult:
    """What `engine.run(plan)` returns: the logits to sample from, and where rows stand."""

    rows: tuple[int, ...]  # rows with a token to sample: decode rows, then finished prompts
    logits: np.ndarray  # [len(rows), vocab] float32: each row's last-position logits
    cursors: Mapping[int, int] = field(default_factory=dict)  # chunk row -> its new cursor
    cached: Mapping[int, int] = field(default_factory=dict)  # fresh row -> prefix tokens reused
    # drafted row -> logits [n, vocab] after each of its first n draft ids (n <= its draft: cut
    # where the row is full); the row's cursor moved past all n until the scheduler rewinds it
    verified: Mapping[int, np.ndarray] = field(default_factory=dict)
    # scoring row -> its chunk's log-probabilities ([1, q] arrays), in the plan's order
    scores: Mapping[int, ScoreChunkResult] = field(default_factory=dict)
