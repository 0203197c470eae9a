"""The MLX engine's decode steps: one token for each of a set of rows in ONE batched forward,
started at once and finished later, so the scheduler can start step n+1 on step n's lazy greedy
ids (`PipelinedEngine`, scheduler/pipelining.py).

Part of `MLXEngine` (a mixin, as mlx_steps.py is): it reads the engine's rows, cursors and
forward (`_graph`), and advances a row only when its step is finished.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from llm_server import blas
from llm_server.engines.base import EngineError

if TYPE_CHECKING:
    from llm_server.engines.mlx_engine import MLXEngine

log = logging.getLogger(__name__)


@dataclass
class DecodeStep:
    """A decode step started by `MLXEngine.decode_start`."""

    rows: list[int]
    epochs: list[int]  # each row's release count at the start
    tokens: Sequence[int] | mx.array  # input ids (ints, or lazy ids of the step before)
    logits: mx.array  # [B, vocab] float32, evaluating
    greedy: mx.array  # [B] int32 argmax of logits, evaluating
    split: bool


class DecodeRunner:
    """The `decode` and pipelined `decode_start`/`decode_finish`/`decode_cancel` half of
    `MLXEngine`."""

    def decode(self: MLXEngine, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self.decode_finish(self.decode_start(rows, tokens))

    def decode_start(
        self: MLXEngine, rows: Sequence[int], tokens: Sequence[int] | mx.array
    ) -> DecodeStep:
        """Build one batched decode step and start evaluating it; returns at once.

        `tokens` may be the lazy `greedy` ids of a step still in flight: the scheduler then
        builds step n+1 while step n computes. Rows advance when the step is finished.
        """
        rows = list(rows)
        if len(rows) != len(tokens) or not rows:
            raise ValueError("decode needs one token per row and at least one row")
        for r in rows:
            self._check_row(r)
        starts = [self.cursor(r) + self._ahead[r] for r in rows]
        for r, s in zip(rows, starts, strict=True):
            if s >= self.context_length:
                raise EngineError(f"row {r} is full ({self.context_length} positions)")
        if isinstance(tokens, mx.array):
            ids = tokens.astype(mx.int32).reshape(-1, 1)
        else:
            ids = mx.array(np.asarray(tokens, dtype=np.int32).reshape(-1, 1))
        split = self._split(len(rows))
        if split:
            self._split_steps += 1
            blas.set_threads(1)  # one BLIS thread per split half until the step is finished
        before = self._states.snapshot(rows)
        try:
            logits = self._graph(rows, starts, ids, split)
            greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
            mx.async_eval(logits, greedy, *self._held())
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            self._states.restore(before)  # the rows' states as before the failed step
            self._end_split(split)
            raise EngineError(f"forward failed: {exc}") from exc
        for r in rows:
            self._ahead[r] += 1
        return DecodeStep(rows, [self._epoch[r] for r in rows], tokens, logits, greedy, split)

    def decode_finish(self: MLXEngine, step: DecodeStep) -> np.ndarray:
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

    def decode_cancel(self: MLXEngine, step: DecodeStep) -> None:
        """Drop `step` without advancing its rows (the positions it wrote are rewritten by the
        next step of each row). Waits for it: nothing may be left computing (see finish)."""
        try:
            mx.eval(step.logits, step.greedy)
        except Exception:  # noqa: BLE001 - its results are dropped anyway
            log.debug("a cancelled decode step failed", exc_info=True)
        finally:
            self._settle(step, None)

    def _settle(self: MLXEngine, step: DecodeStep, tokens: list[int] | None) -> None:
        for i, (r, epoch) in enumerate(zip(step.rows, step.epochs, strict=True)):
            if self._epoch[r] != epoch:
                continue  # released (and maybe reused) while the step was in flight
            self._ahead[r] -= 1
            if tokens is not None:
                self._row_tokens[r].append(tokens[i])
        self._end_split(step.split)

    def _end_split(self: MLXEngine, split: bool) -> None:
        if split:
            self._split_steps -= 1
            if self._split_steps == 0:
                blas.set_threads(blas.default_threads())
