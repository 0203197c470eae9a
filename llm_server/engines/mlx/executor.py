"""Running a step plan on the MLX engine: decode rows, prompt and scoring chunks in ONE forward.

A fresh prompt chunk opens its row first (reset, then the longest prefix held elsewhere is
copied in); a scoring chunk runs on a scoring row (reset at its first chunk), gets logits at
every position, and they are reduced to log-probabilities before `run` returns (C3). The plan
becomes groups of rows (the decode rows at q=1, each drafted length, each chunk at its length)
for `ModelForward.run_groups` (mlx_forward.py); a decode-only plan is a decode step
(mlx_decode.py). Rows advance only when the whole step succeeded.

A prompt's embedding spans (step.py: `EmbeddingSpan`) ride with its chunks: the rows give the
forward the spans' rows at the positions a chunk runs (`span_rows`), and hold the prompt's
cache key (`prompt_key`: the spans' digests at their positions) as its tokens, so the prefix
cache, kept rows and other rows' prefixes match a span only by its content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from llm_server.engines.contract import EngineError
from llm_server.engines.forward.kernels import KernelSet
from llm_server.engines.forward.model import Inputs, ModelForward, RowGroup
from llm_server.engines.kv.rows import RowTable
from llm_server.engines.mlx.decode import DecodePipeline
from llm_server.engines.plan import (
    DecodeRow,
    EmbeddingSpan,
    PrefillChunk,
    ScoreChunk,
    ScoreChunkResult,
    StepPlan,
    StepResult,
    prompt_key,
    span_rows,
)

PREFILL_CHUNK = 512  # prompt positions per prefill forward (bounds activation memory)


class _Drafted(NamedTuple):
    """A stateful row's drafted step, for `StepExecutor.rewind`."""

    state: dict  # the row's state slots before the step (StateStore.snapshot)
    start: int  # its cursor before the step (where its pending token went)
    end: int  # its cursor after the step


class StepExecutor:
    """Turns step plans (and whole prompts) on the rows of `table` into forwards."""

    def __init__(
        self,
        table: RowTable,
        forward: ModelForward,
        decoder: DecodePipeline,
        kernels: KernelSet,
        *,
        context_length: int,
        vocab_size: int,
        speculative: bool,
        model_type: str,
    ) -> None:
        """`speculative`: drafts can be verified (see `MLXEngine.speculative`)."""
        self.table = table
        self.forward = forward
        self.decoder = decoder
        self.kernels = kernels
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.speculative = speculative
        self.model_type = model_type
        # a stateful row's last drafted step: row -> its state before the step, the cursor
        # there and after it (what `rewind` restores and runs again)
        self._drafted: dict[int, _Drafted] = {}

    def prefill(
        self, row: int, tokens: Sequence[int], spans: Sequence[EmbeddingSpan] = ()
    ) -> np.ndarray:
        """Reset `row` and run `tokens` through it in chunks (`spans`: its embedding spans);
        the last position's logits."""
        table = self.table
        table.check_idle(row)
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if n > self.context_length:
            raise ValueError(f"prompt of {n} tokens exceeds the context of {self.context_length}")
        if spans:
            self.forward.check_inputs()
        tokens = [int(t) for t in tokens]
        key = prompt_key(tokens, spans) if spans else tokens
        reused = table.open(row, key)
        logits = None
        for start in range(reused, n, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, n)
            inputs = {0: span_rows(spans, start, end)} if spans else None
            try:
                logits = self.forward.run_groups(
                    [RowGroup([row], [start], [tokens[start:end]])], inputs=inputs
                )
            except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
                raise EngineError(f"forward failed: {exc}") from exc
            table.advance(row, key[start:end])
            table.mark(row, start, n)  # a recurrent state's checkpoint, where one is due
        return logits[0]

    def run(self, plan: StepPlan) -> StepResult:
        """Execute a step plan: the decode rows, every prompt chunk and every scoring chunk in
        ONE forward (the fused layers; separate graphs evaluated together otherwise). Rows
        advance only when the whole forward succeeded."""
        self._drafted.clear()  # a rewind follows its drafted step, before any other
        drafted = any(d.draft for d in plan.decode)
        if not plan.prefill and not plan.score and not drafted:
            if not plan.decode:
                return StepResult((), np.zeros((0, self.vocab_size), np.float32))
            rows = [d.row for d in plan.decode]
            logits = self.decoder.decode(rows, [d.token for d in plan.decode])
            return StepResult(tuple(rows), logits)
        if drafted and not self.speculative:
            raise EngineError(f"{self.model_type}: drafts cannot be verified on this model")
        if any(c.spans for c in plan.prefill):
            self.forward.check_inputs()
        table = self.table
        groups: list[RowGroup] = []
        rows = [d.row for d in plan.decode]
        for r in {*rows, *(c.row for c in plan.prefill)}:
            table.check_idle(r)
        # a drafted row is its own group: its pending token and draft, logits at every position
        # (the draft is cut to the positions the row has left)
        drafts = {
            d.row: list(d.draft[: max(self.context_length - table.cursor(d.row) - 1, 0)])
            for d in plan.decode
            if d.draft and table.cursor(d.row) + 1 < self.context_length
        }
        plain = [d for d in plan.decode if d.row not in drafts]
        if plain:
            starts = [table.cursor(d.row) for d in plain]
            if max(starts) >= self.context_length:
                raise EngineError(f"a row is full ({self.context_length} positions)")
            groups.append(RowGroup([d.row for d in plain], starts, [[d.token] for d in plain]))
        # drafted rows with drafts of one length share a group (one attention per layer for
        # them all, not one per row: per-group work is what made 4 drafted rows cost 2x); the
        # unfused forward reads every position of one-row groups only
        every: set[int] = set()
        order: list[DecodeRow] = []
        by_len: dict[int, list[DecodeRow]] = {}
        for d in plan.decode:
            if d.row in drafts:
                key = len(drafts[d.row]) if self.forward.fused is not None else -1 - len(by_len)
                by_len.setdefault(key, []).append(d)
        for same in by_len.values():
            every.add(len(groups))
            order += same
            groups.append(
                RowGroup(
                    [d.row for d in same],
                    [table.cursor(d.row) for d in same],
                    [[d.token, *drafts[d.row]] for d in same],
                )
            )
        before = table.states.snapshot(
            [*rows, *(c.row for c in plan.prefill), *(c.row for c in plan.score)]
        )
        if table.states.stateful and table.serial_cache is None:
            for r in drafts:
                self._drafted[r] = _Drafted(table.states.snapshot([r]), table.cursor(r), 0)
        cached: dict[int, int] = {}
        segments: list[tuple[PrefillChunk, list[int]]] = []  # each chunk's cache key
        inputs: dict[int, Inputs] = {}  # group -> the embedding rows of its positions
        try:
            for chunk in plan.prefill:
                if chunk.fresh:
                    prompt = prompt_key(chunk.prompt, chunk.spans)
                    if not prompt or len(prompt) > self.context_length:
                        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be run")
                    start = cached[chunk.row] = table.open(chunk.row, prompt)
                else:
                    start = chunk.start
                    if start != table.cursor(chunk.row):
                        raise ValueError(f"row {chunk.row} is at {table.cursor(chunk.row)}")
                # only this chunk's ids: a long prompt is not converted again at every chunk
                end = min(start + chunk.tokens, len(chunk.prompt))
                seg = [int(t) for t in chunk.prompt[start:end]]
                if chunk.spans:
                    inputs[len(groups)] = span_rows(chunk.spans, start, end)
                    segments.append((chunk, prompt_key(chunk.prompt, chunk.spans, start, end)))
                else:
                    segments.append((chunk, seg))
                groups.append(RowGroup([chunk.row], [start], [seg]))
            scored: list[tuple[ScoreChunk, list[int]]] = []
            for sc in plan.score:
                every.add(len(groups))
                ids = self._score_segment(sc)
                scored.append((sc, ids))
                groups.append(RowGroup([sc.row], [sc.start], [ids]))
            logits = self.forward.run_groups(groups, frozenset(every), inputs)
            scores = self._reduce_scores(plan.score, logits)
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            self._drafted.clear()
            table.states.restore(before)
            for chunk in (*plan.prefill, *plan.score):
                if chunk.start == 0:
                    table.forget(chunk.row)  # opened for this step: back to empty
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"forward failed: {exc}") from exc
        # where each decode row's logits are: the plain rows first, then each drafted row's
        # positions (the first predicts after the pending token, the rest after each draft id)
        at = {d.row: i for i, d in enumerate(plain)}
        off, verified = len(plain), {}
        for d in plain:
            table.advance(d.row, [int(d.token)])
        for d in order:  # the drafted rows, in the order of their groups
            n = len(drafts[d.row])
            at[d.row] = off
            verified[d.row] = logits[off + 1 : off + 1 + n]
            table.advance(d.row, [int(d.token), *drafts[d.row]])  # until `rewind`
            if d.row in self._drafted:
                self._drafted[d.row] = self._drafted[d.row]._replace(end=table.cursor(d.row))
            off += n + 1
        picked = [at[r] for r in rows]
        cursors: dict[int, int] = {}
        for i, (chunk, seg) in enumerate(segments):
            table.advance(chunk.row, seg)
            cursors[chunk.row] = table.cursor(chunk.row)
            table.mark(chunk.row, cursors[chunk.row] - len(seg), len(chunk.prompt))
            if cursors[chunk.row] == len(chunk.prompt):
                picked.append(off + i)
        out_rows = tuple(rows + [c.row for c, _ in segments if cursors[c.row] == len(c.prompt)])
        for sc, ids in scored:
            table.advance(sc.row, ids)
        return StepResult(out_rows, logits[picked], cursors, cached, verified, scores)

    def rewind(self, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on (a draft's rejected tail). A row with
        recurrent layers cannot cut its state back: its state from before the drafted step is
        restored and the kept positions (its pending token and the accepted draft ids) run
        through the model again, which rewrites their KV with the same values; with every
        draft id accepted there is nothing to do."""
        table = self.table
        drafted = self._drafted.get(row)
        if not table.states.stateful or cursor == table.cursor(row):
            table.rewind(row, cursor)
            return
        if drafted is None or drafted.end != table.cursor(row) or cursor < drafted.start:
            raise EngineError(
                f"{self.model_type}: a row with recurrent layers rewinds only within its "
                "last drafted step"
            )
        del self._drafted[row]
        table.rewind(row, cursor)
        table.states.restore(drafted.state)
        if cursor == drafted.start:
            return
        kept = table.tokens[row][drafted.start : cursor]
        try:
            self.forward.run_groups([RowGroup([row], [drafted.start], [kept])])
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            table.states.restore(drafted.state)
            del table.tokens[row][drafted.start :]
            raise EngineError(f"forward failed: {exc}") from exc

    def _score_segment(self, chunk: ScoreChunk) -> list[int]:
        """The ids a scoring chunk runs, its row reset first when the chunk opens it."""
        table = self.table
        table.check_row(chunk.row, scoring=True)
        if chunk.row < table.rows:
            raise ValueError(f"row {chunk.row} is a serving row, not a scoring row")
        if not 0 <= chunk.start < chunk.end <= min(len(chunk.prompt), self.context_length):
            raise ValueError(f"a scoring chunk {chunk.start}..{chunk.end} cannot be run")
        if chunk.start == 0:
            table.forget(chunk.row)
            table.states.clear_row(chunk.row)  # a recurrent state starts afresh per prompt
        elif chunk.start != table.cursor(chunk.row):
            raise ValueError(f"scoring row {chunk.row} is at {table.cursor(chunk.row)}")
        return [int(t) for t in chunk.prompt[chunk.start : chunk.end]]

    def _reduce_scores(
        self, chunks: tuple[ScoreChunk, ...], logits: np.ndarray
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
