"""The MLX engine's decode steps: one token for each of a set of rows in ONE batched forward,
started at once and finished later, so the scheduler can start step n+1 on step n's lazy greedy
ids (`PipelinedEngine`, scheduler/pipelining.py). A row advances only when its step is
finished; a row released meanwhile is left alone (its epoch moved on).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import EngineError
from llm_server.engines.forward.model import ModelForward
from llm_server.engines.kv.rows import RowTable

log = logging.getLogger(__name__)


@dataclass
class DecodeStep:
    """A decode step started by `DecodePipeline.start`."""

    rows: list[int]
    epochs: list[int]  # each row's release count at the start
    tokens: Sequence[int] | mx.array  # input ids (ints, or lazy ids of the step before)
    logits: mx.array  # [B, vocab] float32, evaluating
    greedy: mx.array  # [B] int32 argmax of logits, evaluating
    context: ExitStack  # the kernel set's context of the step, entered until it is settled


class DecodePipeline:
    """Decode steps of the rows in `table` through `forward`: `decode`, and the pipelined
    `start`/`finish`/`cancel` (the engine's `decode_start`/`decode_finish`/`decode_cancel`)."""

    def __init__(self, table: RowTable, forward: ModelForward, context_length: int) -> None:
        self.table = table
        self.forward = forward
        self.context_length = context_length

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each of `rows` in one batched forward; logits [B, vocab]."""
        return self.finish(self.start(rows, tokens))

    def start(self, rows: Sequence[int], tokens: Sequence[int] | mx.array) -> DecodeStep:
        """Build one batched decode step and start evaluating it; returns at once.

        `tokens` may be the lazy `greedy` ids of a step still in flight: the scheduler then
        builds step n+1 while step n computes. Rows advance when the step is finished.
        """
        rows = list(rows)
        if len(rows) != len(tokens) or not rows:
            raise ValueError("decode needs one token per row and at least one row")
        table = self.table
        for r in rows:
            table.check_row(r)
        starts = table.decode_starts(rows)
        for r, s in zip(rows, starts, strict=True):
            if s >= self.context_length:
                raise EngineError(f"row {r} is full ({self.context_length} positions)")
        if isinstance(tokens, mx.array):
            ids = tokens.astype(mx.int32).reshape(-1, 1)
        else:
            ids = mx.array(np.asarray(tokens, dtype=np.int32).reshape(-1, 1))
        context = self.forward.context(len(rows))
        held = ExitStack()  # the context entered until the step is finished or dropped
        held.enter_context(context)
        before = table.states.snapshot(rows)
        try:
            logits = self.forward.graph(rows, starts, ids, context)
            greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
            mx.async_eval(logits, greedy, *table.held())
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            table.states.restore(before)  # the rows' states as before the failed step
            held.close()
            raise EngineError(f"forward failed: {exc}") from exc
        epochs = table.start_decode(rows)
        return DecodeStep(rows, epochs, tokens, logits, greedy, held)

    def finish(self, step: DecodeStep) -> np.ndarray:
        """Wait for `step`; advance its rows (those not released since); logits [B, vocab]."""
        try:
            # wait for everything the step started, not only the logits: work left pending on
            # a stream of a thread that then exits aborts the process ("terminate called")
            mx.eval(step.logits, step.greedy)
            logits = np.array(step.logits, copy=False)
            if isinstance(step.tokens, mx.array):
                tokens = np.array(step.tokens).reshape(-1).tolist()
            else:
                tokens = [int(t) for t in step.tokens]
        except Exception as exc:  # noqa: BLE001
            self._settle(step, None)
            raise EngineError(f"forward failed: {exc}") from exc
        self._settle(step, tokens)
        return logits

    def cancel(self, step: DecodeStep) -> None:
        """Drop `step` without advancing its rows (the positions it wrote are rewritten by the
        next step of each row). Waits for it: nothing may be left computing (see finish)."""
        try:
            mx.eval(step.logits, step.greedy)
        except Exception:  # noqa: BLE001 - its results are dropped anyway
            log.debug("a cancelled decode step failed", exc_info=True)
        finally:
            self._settle(step, None)

    def _settle(self, step: DecodeStep, tokens: list[int] | None) -> None:
        self.table.finish_decode(step.rows, step.epochs, tokens)
        step.context.close()
