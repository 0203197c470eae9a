"""The messages that cross the scheduler boundary: requests in, events out."""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_server.decoding import Decoder, FinishReason, TokenLogprob
from llm_server.engines.plan import EmbeddingSpan
from llm_server.scheduler.draft_state import DraftState, PredictionUsage


class QueueFull(Exception):
    """Every row is busy and the wait queue is full (HTTP 429)."""

    def __init__(self, running: int, queued: int, retry_after: float = 1.0) -> None:
        super().__init__(
            f"the server is full: {running} requests running and {queued} queued; retry later"
        )
        self.retry_after = retry_after


class SchedulerClosed(Exception):
    """The scheduler is shutting down or failed to load and admits nothing new (HTTP 503)."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it made safe to show."""

    token_id: int
    text: str
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class Timings:
    """Seconds from submission; None where the request never got that far."""

    queue_wait: float | None
    first_token: float | None
    total: float


@dataclass(frozen=True)
class FinishEvent:
    """The last event of every request, whatever happened to it."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str | None = None  # set when reason is ERROR
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prediction: PredictionUsage | None = None  # predicted-output counts (None: no prediction)


Event = TokenEvent | FinishEvent


class Priority(enum.Enum):
    """Who waits on a request: a person (interactive) or nobody (a Batch API line, S11)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"  # queued behind every interactive request, outside --max-queued


_ids = itertools.count(1)


@dataclass(eq=False)
class GenerationRequest:
    """Per-request state owned by the scheduler thread once submitted."""

    prompt: list[int]
    decoder: Decoder
    emit: Callable[[Event], None]  # called on the scheduler thread; must not block
    exclusive: bool = False  # run alone: the batch pauses while this request decodes
    priority: Priority = Priority.INTERACTIVE
    # output ids at the end of `prompt`: a preempted batch line is queued again with its
    # output so far appended, so its prefill recomputes (or finds cached) what its row held
    resumed_tokens: int = 0
    seq: int = field(default_factory=lambda: next(_ids))
    row: int | None = None
    last_token: int | None = None
    prefilled: int = 0  # prompt positions held in the row (== len(prompt): decoding)
    cached_tokens: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    first_token_at: float | None = None
    draft: DraftState | None = None  # speculative drafting record (None: never drafted)
    # OpenAI predicted output: token ids the output is expected to repeat (a drafting source)
    prediction: tuple[int, ...] | None = None
    # input embeddings at prompt positions (placeholder ids there), computed elsewhere (a
    # vision tower): the forward takes them instead of those ids' embeddings (step.py)
    embeddings: tuple[EmbeddingSpan, ...] = ()
    # waiting for room in the memory budget (its prompt's KV growth was refused, batch.py
    # `_park`): queued again, admitted no sooner than `memory_retry_at` unless a row was
    # freed after `memory_parked_at`, failed once `memory_deadline` passes (time.monotonic())
    memory_parked_at: float | None = None
    memory_retry_at: float = 0.0
    memory_deadline: float | None = None
    _wake: Callable[[], None] | None = None

    @property
    def prompt_tokens(self) -> int:
        """The request's own prompt length (without output re-fed after a preemption)."""
        return len(self.prompt) - self.resumed_tokens

    def cancel(self) -> None:
        """Ask the scheduler to drop this request (thread-safe, idempotent)."""
        self.cancelled.set()
        if self._wake is not None:
            self._wake()

    def timings(self) -> Timings:
        now = time.monotonic()
        return Timings(
            queue_wait=None if self.started_at is None else self.started_at - self.submitted_at,
            first_token=None
            if self.first_token_at is None
            else self.first_token_at - self.submitted_at,
            total=now - self.submitted_at,
        )
