"""Running a step plan on the MLX engine: decode rows and prompt chunks in ONE forward.

Part of `MLXEngine` (a mixin; the row store, prefill and decode stay in mlx_engine.py). A fresh
chunk opens its row first (reset, then the longest prefix held elsewhere is copied in). On the
fused layers every group (the decode rows at q=1, each chunk at its length) shares one packed
forward (`FusedDecoder.forward_groups`); other models build one graph per group over the same
row store and state slots and evaluate them together. Rows advance only when the whole step
succeeded.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from llm_server import blas
from llm_server.engines.base import EngineError
from llm_server.engines.layout import row_views
from llm_server.engines.step import PrefillChunk, StepPlan, StepResult

if TYPE_CHECKING:
    from llm_server.engines.mlx_engine import MLXEngine


class StepRunner:
    """The `run(plan)` half of `MLXEngine`."""

    def run(self: MLXEngine, plan: StepPlan) -> StepResult:
        """Execute a step plan: the decode rows and every prompt chunk in ONE forward (the
        fused layers; separate graphs evaluated together otherwise). Rows advance only when
        the whole forward succeeded."""
        if not plan.prefill:
            if not plan.decode:
                return StepResult((), np.zeros((0, self.vocab_size), np.float32))
            rows = [d.row for d in plan.decode]
            return StepResult(tuple(rows), self.decode(rows, [d.token for d in plan.decode]))
        groups: list[tuple[list[int], list[int], list[list[int]]]] = []
        rows = [d.row for d in plan.decode]
        for r in {*rows, *(c.row for c in plan.prefill)}:
            self._check_row(r)
            if self._ahead[r]:
                raise RuntimeError(f"row {r} has a decode step in flight")
        if rows:
            starts = [self.cursor(r) for r in rows]
            if max(starts) >= self.context_length:
                raise EngineError(f"a row is full ({self.context_length} positions)")
            groups.append((rows, starts, [[d.token] for d in plan.decode]))
        before = self._states.snapshot([*rows, *(c.row for c in plan.prefill)])
        cached: dict[int, int] = {}
        segments: list[tuple[PrefillChunk, list[int]]] = []
        try:
            for chunk in plan.prefill:
                prompt = [int(t) for t in chunk.prompt]
                if chunk.fresh:
                    if not prompt or len(prompt) > self.context_length:
                        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be run")
                    start = cached[chunk.row] = self._open(chunk.row, prompt)
                else:
                    start = chunk.start
                    if start != self.cursor(chunk.row):
                        raise ValueError(f"row {chunk.row} is at {self.cursor(chunk.row)}")
                seg = prompt[start : min(len(prompt), start + chunk.tokens)]
                segments.append((chunk, seg))
                groups.append(([chunk.row], [start], [seg]))
            logits = self._run_groups(groups)
        except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
            self._states.restore(before)
            for chunk in plan.prefill:
                if chunk.fresh:
                    self._row_tokens[chunk.row] = []  # opened for this step: back to empty
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"forward failed: {exc}") from exc
        for d in plan.decode:
            self._row_tokens[d.row].append(int(d.token))
        picked = list(range(len(rows)))
        cursors: dict[int, int] = {}
        for i, (chunk, seg) in enumerate(segments):
            self._row_tokens[chunk.row].extend(int(t) for t in seg)
            cursors[chunk.row] = self.cursor(chunk.row)
            if cursors[chunk.row] == len(chunk.prompt):
                picked.append(len(rows) + i)
        out_rows = tuple(rows + [c.row for c, _ in segments if cursors[c.row] == len(c.prompt)])
        return StepResult(out_rows, logits[picked], cursors, cached)

    def _run_groups(self: MLXEngine, groups: list[tuple[list[int], list[int], list[list[int]]]]):
        """Logits [rows, vocab] (numpy) of each group row's last position, evaluated now."""
        positions = sum(len(rows) * len(toks[0]) for rows, _, toks in groups)
        split = self._split(positions)
        with blas.threads(1) if split else nullcontext():
            self._store.ensure(max(max(s) + len(t[0]) for _, s, t in groups))
            if self._fused is not None:
                parts = []
                for rows, starts, toks in groups:
                    ids = mx.array(np.asarray(toks, dtype=np.int32))
                    plan = self._forward_plan(rows, starts, ids.shape[1])
                    views = row_views(self._layout, self._store, self._states, plan)
                    parts.append((ids, views, starts, plan.mask))
                logits = self._fused.forward_groups(parts, split).astype(mx.float32)
            else:
                logits = mx.concatenate(
                    [
                        self._graph(rows, starts, mx.array(np.asarray(t, dtype=np.int32)), split)
                        for rows, starts, t in groups
                    ]
                )
            mx.eval(logits, *self._held())
        return np.array(logits, copy=False)
