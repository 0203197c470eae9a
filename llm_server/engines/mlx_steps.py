"""Running a step plan on the MLX engine: decode rows, prompt and scoring chunks in ONE forward.

Part of `MLXEngine` (a mixin; the row store and prefill stay in mlx_engine.py). A fresh prompt
chunk opens its row first (reset, then the longest prefix held elsewhere is copied in); a
scoring chunk runs on a scoring row (reset at its first chunk), gets logits at every position,
and they are reduced to log-probabilities before `run` returns (C3). On the fused layers every
group (the decode rows at q=1, each chunk at its length) shares one packed forward
(`FusedForward.forward_groups`); other models build one graph per group over the same row store
and state slots and evaluate them together. Rows advance only when the whole step succeeded.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from llm_server import blas
from llm_server.engines.base import EngineError
from llm_server.engines.layout import row_views
from llm_server.engines.step import (
    DecodeRow,
    PrefillChunk,
    ScoreChunk,
    ScoreChunkResult,
    StepPlan,
    StepResult,
)

if TYPE_CHECKING:
    from llm_server.engines.mlx_engine import MLXEngine


class StepRunner:
    """The `run(plan)` half of `MLXEngine`."""

    def run(self: MLXEngine, plan: StepPlan) -> StepResult:
        """Execute a step plan: the decode rows, every prompt chunk and every scoring chunk in
        ONE forward (the fused layers; separate graphs evaluated together otherwise). Rows
        advance only when the whole forward succeeded."""
        drafted = any(d.draft for d in plan.decode)
        if not plan.prefill and not plan.score and not drafted:
            if not plan.decode:
                return StepResult((), np.zeros((0, self.vocab_size), np.float32))
            rows = [d.row for d in plan.decode]
            return StepResult(tuple(rows), self.decode(rows, [d.token for d in plan.decode]))
        if drafted and not self.speculative:
            raise EngineError(f"{self.model_type}: drafts cannot be verified on this model")
        groups: list[tuple[list[int], list[int], list[list[int]]]] = []
        rows = [d.row for d in plan.decode]
        for r in {*rows, *(c.row for c in plan.prefill)}:
            self._check_row(r)
            if self._ahead[r]:
                raise RuntimeError(f"row {r} has a decode step in flight")
        # a drafted row is its own group: its pending token and draft, logits at every position
        # (the draft is cut to the positions the row has left)
        drafts = {
            d.row: list(d.draft[: max(self.context_length - self.cursor(d.row) - 1, 0)])
            for d in plan.decode
            if d.draft and self.cursor(d.row) + 1 < self.context_length
        }
        plain = [d for d in plan.decode if d.row not in drafts]
        if plain:
            starts = [self.cursor(d.row) for d in plain]
            if max(starts) >= self.context_length:
                raise EngineError(f"a row is full ({self.context_length} positions)")
            groups.append(([d.row for d in plain], starts, [[d.token] for d in plain]))
        # drafted rows with drafts of one length share a group (one attention per layer for
        # them all, not one per row: per-group work is what made 4 drafted rows cost 2x); the
        # unfused forward reads every position of one-row groups only
        every: set[int] = set()
        order: list[DecodeRow] = []
        by_len: dict[int, list[DecodeRow]] = {}
        for d in plan.decode:
            if d.row in drafts:
                key = len(drafts[d.row]) if self._fused is not None else -1 - len(by_len)
                by_len.setdefault(key, []).append(d)
        for same in by_len.values():
            every.add(len(groups))
            order += same
            groups.append(
                (
                    [d.row for d in same],
                    [self.cursor(d.row) for d in same],
                    [[d.token, *drafts[d.row]] for d in same],
                )
            )
        before = self._states.snapshot([*rows, *(c.row for c in plan.prefill)])
        cached: dict[int, int] = {}
        segments: list[tuple[PrefillChunk, list[int]]] = []
        try:
            for chunk in plan.prefill:
                if chunk.fresh:
                    prompt = [int(t) for t in chunk.prompt]
                    if not prompt or len(prompt) > self.context_length:
                        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be run")
                    start = cached[chunk.row] = self._open(chunk.row, prompt)
                else:
                    start = chunk.start
                    if start != self.cursor(chunk.row):
                        raise ValueError(f"row {chunk.row} is at {self.cursor(chunk.row)}")
                # only this chunk's ids: a long prompt is not converted again at every chunk
                seg = [int(t) for t in chunk.prompt[start : start + chunk.tokens]]
                segments.append((chunk, seg))
                groups.append(([chunk.row], [start], [seg]))
            scored: list[tuple[ScoreChunk, list[int]]] = []
            for sc in plan.score:
                every.add(len(groups))
                ids = self._score_segment(sc)
                scored.append((sc, ids))
                groups.append(([sc.row], [sc.start], [ids]))
            logits = self._run_groups(groups, frozenset(every))
            scores = self._reduce_scores(plan.score, logits)
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            self._states.restore(before)
            for chunk in (*plan.prefill, *plan.score):
                if chunk.start == 0:
                    self._row_tokens[chunk.row] = []  # opened for this step: back to empty
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"forward failed: {exc}") from exc
        # where each decode row's logits are: the plain rows first, then each drafted row's
        # positions (the first predicts after the pending token, the rest after each draft id)
        at = {d.row: i for i, d in enumerate(plain)}
        off, verified = len(plain), {}
        for d in plain:
            self._row_tokens[d.row].append(int(d.token))
        for d in order:  # the drafted rows, in the order of their groups
            n = len(drafts[d.row])
            at[d.row] = off
            verified[d.row] = logits[off + 1 : off + 1 + n]
            self._row_tokens[d.row].extend([int(d.token), *drafts[d.row]])  # until `rewind`
            off += n + 1
        picked = [at[r] for r in rows]
        cursors: dict[int, int] = {}
        for i, (chunk, seg) in enumerate(segments):
            self._row_tokens[chunk.row].extend(seg)
            cursors[chunk.row] = self.cursor(chunk.row)
            if cursors[chunk.row] == len(chunk.prompt):
                picked.append(off + i)
        out_rows = tuple(rows + [c.row for c, _ in segments if cursors[c.row] == len(c.prompt)])
        for sc, ids in scored:
            self._row_tokens[sc.row].extend(ids)
        return StepResult(out_rows, logits[picked], cursors, cached, verified, scores)

    def _score_segment(self: MLXEngine, chunk: ScoreChunk) -> list[int]:
        """The ids a scoring chunk runs, its row reset first when the chunk opens it."""
        self._check_row(chunk.row, scoring=True)
        if chunk.row < self.rows:
            raise ValueError(f"row {chunk.row} is a serving row, not a scoring row")
        if not 0 <= chunk.start < chunk.end <= min(len(chunk.prompt), self.context_length):
            raise ValueError(f"a scoring chunk {chunk.start}..{chunk.end} cannot be run")
        if chunk.start == 0:
            self._row_tokens[chunk.row] = []
        elif chunk.start != self.cursor(chunk.row):
            raise ValueError(f"scoring row {chunk.row} is at {self.cursor(chunk.row)}")
        return [int(t) for t in chunk.prompt[chunk.start : chunk.end]]

    def _reduce_scores(
        self: MLXEngine, chunks: tuple[ScoreChunk, ...], logits: np.ndarray
    ) -> dict[int, ScoreChunkResult]:
        """Each scoring chunk's log-probabilities ([1, q] arrays), reduced over all scoring
        positions at once (C3: the [positions, vocab] logits are never kept)."""
        if not chunks:
            return {}
        # the scoring positions are the last rows of `logits`, in plan order (forward_groups)
        n = sum(c.tokens for c in chunks)
        at = len(logits) - n
        targets = np.concatenate([np.asarray(c.targets(), np.int32) for c in chunks])[None]
        k = min(max(c.top_k for c in chunks), self.vocab_size)
        result = self.kernels.reduce_scores(logits[at:][None], targets, k)
        out, off = {}, 0
        for c in chunks:
            part = slice(off, off + c.tokens)
            out[c.row] = ScoreChunkResult(  # each chunk its own k: the same for all its chunks
                token_logprobs=result.token_logprobs[:, part],
                top_ids=result.top_ids[:, part, : c.top_k],
                top_logprobs=result.top_logprobs[:, part, : c.top_k],
                greedy_ids=result.greedy_ids[:, part],
            )
            off += c.tokens
        return out

    def rewind(self: MLXEngine, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on (a draft's rejected tokens): the row's token
        list, hence what the prefix cache gets, holds only accepted tokens; the KV stored there
        is overwritten by the next forward."""
        self._check_row(row)
        if not self.speculative:
            raise EngineError(f"{self.model_type}: a row cannot be rewound")
        if not 0 <= cursor <= self.cursor(row):
            raise ValueError(f"row {row} holds {self.cursor(row)} positions, not {cursor}")
        del self._row_tokens[row][cursor:]

    def _run_groups(
        self: MLXEngine,
        groups: list[tuple[list[int], list[int], list[list[int]]]],
        every: frozenset[int] = frozenset(),
    ):
        """Logits [rows, vocab] (numpy) of each group row's last position (every position of
        the groups in `every`, row by row; the unfused forward gets only one-row groups
        there), evaluated now."""
        positions = sum(len(rows) * len(toks[0]) for rows, _, toks in groups)
        split = self._split(positions)
        with blas.threads(1) if split else nullcontext():
            # the store grows before any group's views are made: every view reads the same arrays
            self._store.ensure_rows(max(max(r) for r, _, _ in groups) + 1)
            self._store.ensure(max(max(s) + len(t[0]) for _, s, t in groups))
            if self._fused is not None:
                parts = []
                for rows, starts, toks in groups:
                    ids = mx.array(np.asarray(toks, dtype=np.int32))
                    plan = self._forward_plan(rows, starts, ids.shape[1])
                    views = row_views(self._layout, self._store, self._states, plan)
                    parts.append((ids, views, starts, plan.mask))
                logits = self._fused.forward_groups(parts, split, every).astype(mx.float32)
            else:
                parts = []
                for g, (rows, starts, t) in enumerate(groups):
                    ids = mx.array(np.asarray(t, dtype=np.int32))
                    parts.append(self._graph(rows, starts, ids, split, g in every))
                    if self.stage is not None:
                        # a pipeline stage evaluates one group's transfers at a time: MLX may
                        # order independent graphs differently on each rank, and the ring's
                        # messages carry no tags to pair them up
                        mx.eval(parts[-1], *self._held())
                logits = mx.concatenate(parts)
            mx.eval(logits, *self._held())
        return np.array(logits, copy=False)
