"""Scoring (`/v1/completions` echo+logprobs): every prompt's log-probabilities (C1-C5).

A request's prompts enter one shortest-first queue together (C1; shortest_first.py). On an
engine whose row store holds scoring rows (`Engine.score_rows`), each free scoring row takes the
next shortest prompt, and the planner gives the open prompts chunks of the step's budget
(planner.py rule 5): they run as rows of the same forward as the decode rows, each chunk's
logits reduced to log-probabilities on the engine before the next chunk (C3), with no padding.
Elsewhere the fallback, score_session.py, scores padded batches on the engine's separate
session between steps (C2-C4). `Scorer.attach` picks one of the two, once, when the engine is
loaded. A request completes when all of its prompts have been scored.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from llm_server.decoding import MAX_TOP_LOGPROBS
from llm_server.engines.contract import Engine, ScoreChunkResult
from llm_server.engines.plan import ScoreChunk
from llm_server.scheduler.score_session import ScoreForward, SessionScoring, join_chunks
from llm_server.scheduler.shortest_first import PumpRequest, ShortestFirstQueue

log = logging.getLogger(__name__)

MAX_SCORE_BATCH = 32  # prompts per padded batch on the session fallback


@dataclass(frozen=True)
class ScoredPrompt:
    """Log-probabilities of one prompt (plus an optional greedy next token)."""

    tokens: list[int]  # prompt ids, then the generated token when one was asked for
    token_logprobs: list[float | None]  # per token; the first entry is None
    top_logprobs: list[list[tuple[int, float]] | None]  # per token, best first; first is None
    generated: int | None  # the greedy next token id (max_tokens 1), else None


class ScoringError(RuntimeError):
    """A scoring forward failed; every request in that batch gets this error."""


_seqs = itertools.count(1)


@dataclass(eq=False)
class ScoreRequest(PumpRequest):
    """One completions request: all its prompts score together; `future` gets the results."""

    prompts: list[list[int]]
    top_k: int
    generate_one: bool
    future: Future = field(default_factory=Future)
    seq: int = field(default_factory=lambda: next(_seqs))
    results: list[ScoredPrompt | None] = field(default_factory=list)
    remaining: int = 0
    started: bool = False  # a prompt entered a batch; the caller can no longer cancel

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)
        self.remaining = len(self.prompts)

    @property
    def engine_k(self) -> int:
        """Top-k entries asked of the engine: the generated token's logprob is the top-1."""
        return max(self.top_k, 1) if self.generate_one else self.top_k


@dataclass(frozen=True)
class _Queued:
    request: ScoreRequest
    index: int  # which of the request's prompts

    @property
    def tokens(self) -> list[int]:
        return self.request.prompts[self.index]


@dataclass(eq=False)
class OpenPrompt:
    """A prompt being scored on a scoring row (scheduler thread): what the planner reads."""

    key: int  # stable id of this prompt while it is open (ScoreChunk.key)
    queued: _Queued
    row: int  # the engine's scoring row it runs on
    top_k: int  # k asked of the engine
    done: int = 0  # positions scored so far (the row's cursor)
    parts: list[ScoreChunkResult] = field(default_factory=list)  # one per chunk, [1, q]

    @property
    def prompt(self) -> list[int]:
        return self.queued.tokens


def check_prompts(prompts: Sequence[Sequence[int]], context_length: int | None, top_k: int) -> None:
    """Raise ValueError with numbers a user can act on when a scoring request cannot run
    (`context_length` None: the engine is not loaded yet, lengths are not checked)."""
    if not prompts:
        raise ValueError("prompt must not be empty")
    if not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_k}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if context_length is not None and len(p) > context_length:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; the model's context is {context_length} tokens"
            )


class Scorer:
    """Queues score requests; scores them on the engine's scoring rows inside the step plans,
    or, as the fallback, on its separate session (`session`, a pump)."""

    def __init__(
        self,
        wake: Callable[[], None] = lambda: None,
        max_batch: int = MAX_SCORE_BATCH,
        max_queued: int = 64,
        retry_after: float = 1.0,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._queue = ShortestFirstQueue(wake, max_queued, retry_after, "scoring")
        self.session = SessionScoring(
            self._take, lambda m: m.request.engine_k, self._finish, self._fail, max_batch
        )
        self.session.has_queued = lambda: bool(self._queue)
        self._free: list[int] = []  # scoring rows nobody holds (row-store scoring)
        self._open: list[OpenPrompt] = []  # in the order they were opened (shortest first)
        self._keys = itertools.count(1)

    @property
    def trace(self) -> collections.deque[ScoreForward]:
        """The fallback session's forwards (tests, diagnostics); empty on scoring rows."""
        return self.session.trace

    # -- any thread ------------------------------------------------------------------

    def submit(
        self,
        prompts: list[list[int]],
        top_k: int,
        generate_one: bool,
        context_length: int | None = None,
    ) -> ScoreRequest:
        """Check and queue every prompt of one request together (C1): the one place scoring
        prompts are validated (ValueError); raises QueueFull/SchedulerClosed when full."""
        check_prompts(prompts, context_length, top_k)
        req = ScoreRequest([list(p) for p in prompts], top_k, generate_one)
        self._queue.push(req, [_Queued(req, i) for i in range(len(req.prompts))])
        return req

    def pending(self) -> bool:
        """Any scoring work: queued, open on scoring rows, or a session batch."""
        return bool(self._queue) or bool(self._open) or self.session.pending()

    def close(self) -> None:
        """Refuse new requests and fail the queued ones (the scheduler thread has stopped)."""
        for item in self._queue.close():
            item.request.fail(self._queue.closed_error())
        for p in self._open:
            p.queued.request.fail(self._queue.closed_error())
        self._open = []

    # -- the scheduler thread --------------------------------------------------------

    def attach(self, engine: Engine) -> bool:
        """Choose where scoring runs, once, when the engine is loaded: on the row store's
        scoring rows (True) or on the separate session, the fallback (False)."""
        rows = engine.score_rows
        self._free = list(range(engine.rows, engine.rows + rows))
        self.session.enabled = rows == 0
        return rows > 0

    def run_batch(self, engine: Engine) -> None:
        """The fallback: one forward of the session's padded batch (score_session.py)."""
        self.session.run_batch(engine)

    def open_prompts(self, engine: Engine) -> tuple[OpenPrompt, ...]:
        """The prompts to plan this step: abandoned ones dropped, then free scoring rows take
        the next shortest queued prompts."""
        for p in [p for p in self._open if p.queued.request.abandoned]:
            self._close(engine, p)
        if self._free and self._queue:
            for m in self._take(len(self._free), padded=False):
                key = next(self._keys)
                self._open.append(OpenPrompt(key, m, self._free.pop(0), m.request.engine_k))
        return tuple(self._open)

    def commit(
        self, engine: Engine, chunks: Sequence[ScoreChunk], scores: Mapping[int, ScoreChunkResult]
    ) -> None:
        """Note each chunk's reduced results; deliver and free the prompts now complete."""
        by_key = {p.key: p for p in self._open}
        for chunk in chunks:
            p = by_key.get(chunk.key)
            if p is None:
                continue
            try:
                p.parts.append(scores[chunk.row])
                p.done = chunk.end
                if p.done >= len(p.prompt):
                    self._close(engine, p)
                    self._finish(p.queued, join_chunks(p.parts))
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill the scheduler
                self._drop(engine, p.queued, exc)

    def fail(self, engine: Engine, chunk: ScoreChunk, exc: Exception) -> None:
        """A forward failed on `chunk`: its request fails, its other open prompts close."""
        p = next((p for p in self._open if p.key == chunk.key), None)
        if p is not None:
            self._drop(engine, p.queued, exc)

    def _drop(self, engine: Engine, queued: _Queued, exc: Exception) -> None:
        log.error("scoring request %d failed: %s", queued.request.seq, exc)
        self._fail([queued], exc)
        for q in [q for q in self._open if q.queued.request is queued.request]:
            self._close(engine, q)

    def _close(self, engine: Engine, p: OpenPrompt) -> None:
        self._open.remove(p)
        self._free.append(p.row)
        self._free.sort()
        try:
            engine.release(p.row)
        except Exception as exc:  # noqa: BLE001 - the row is reset when it is opened again
            log.warning("releasing scoring row %d failed: %s", p.row, exc)

    def _take(self, cap: int, padded: bool = True) -> list[_Queued]:
        return [m for m in self._queue.take(cap, padded) if m.request.claim()]

    def _finish(self, m: _Queued, result: ScoreChunkResult) -> None:
        """One prompt's results [1, T] are complete: the request completes with its last."""
        req = m.request
        if req.abandoned:
            return
        req.results[m.index] = _scored(m.tokens, result, req)
        req.remaining -= 1
        if req.remaining == 0:
            req.future.set_result(list(req.results))

    def _fail(self, members: Sequence[_Queued], exc: Exception) -> None:
        err = ScoringError(f"scoring failed: {exc}")
        for m in members:
            m.request.fail(err)


def _scored(tokens: list[int], r: ScoreChunkResult, req: ScoreRequest) -> ScoredPrompt:
    """One prompt's result from its [1, T] arrays: position i's outputs describe token i+1."""
    token_lp, top_ids, top_lp, greedy = (
        r.token_logprobs[0],
        r.top_ids[0],
        r.top_logprobs[0],
        r.greedy_ids[0],
    )
    n, k = len(tokens), req.top_k
    lps: list[float | None] = [None] + [float(x) for x in token_lp[: n - 1]]
    tops: list[list[tuple[int, float]] | None] = [None] + [
        _top(top_ids[i], top_lp[i], k) for i in range(n - 1)
    ]
    generated = None
    out = list(tokens)
    if req.generate_one:
        generated = int(greedy[n - 1])
        out.append(generated)
        lps.append(float(top_lp[n - 1, 0]))
        tops.append(_top(top_ids[n - 1], top_lp[n - 1], k))
    return ScoredPrompt(tokens=out, token_logprobs=lps, top_logprobs=tops, generated=generated)


def _top(ids: np.ndarray, lps: np.ndarray, k: int) -> list[tuple[int, float]]:
    return [(int(i), float(lp)) for i, lp in zip(ids[:k], lps[:k], strict=True)]
