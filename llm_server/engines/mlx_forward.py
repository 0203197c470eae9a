"""The MLX engine's forward over its rows: groups of rows at their cursors -> logits.

A group is rows that take the same number of new positions (the decode rows at q=1, a prompt
chunk, a drafted row's pending token and draft, a scoring chunk). On the fused layers every
group of a step shares one packed forward (`FusedForward.forward_groups`); other models build
one graph per group over views of the same row store and state slots (layout.row_views), and
they are evaluated together. A model served serially runs on mlx-lm's caches of its one row.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import mlx.core as mx
import numpy as np

from llm_server.engines.fused_decode import FusedForward
from llm_server.engines.kernels import KernelSet
from llm_server.engines.layout import Layout, last_logits, output_head, row_views
from llm_server.engines.mlx_rows import RowTable
from llm_server.engines.row_cache import ForwardPlan, row_mask

# (rows, their cursors, each row's new ids): rows that take the same number of positions
Group = tuple[list[int], list[int], list[list[int]]]


class ModelForward:
    """Runs groups of rows through the model, reading and writing the rows' KV in `table`."""

    def __init__(
        self,
        model: Any,
        layout: Layout,
        table: RowTable,
        kernels: KernelSet,
        fused: FusedForward | None,
        *,
        dtype: str,
        inner: str | None,
        plain_head: bool,
        grouped_scores: bool,
        stage: Any = None,
    ) -> None:
        """`fused`: the stacked-product forward (None: mlx-lm's); `inner`: the model's
        decoder-stack attribute; `plain_head`: its head is a plain product of the final norm
        (else mlx-lm's own head runs); `grouped_scores`: attention scores grouped per kv head;
        `stage`: this rank's layers when split pipeline-parallel."""
        self.model = model
        self.layout = layout
        self.table = table
        self.kernels = kernels
        self.fused = fused
        self.dtype = dtype
        self.inner = inner
        self.plain_head = plain_head
        self.grouped_scores = grouped_scores
        self.stage = stage

    def context(self, positions: int) -> AbstractContextManager:
        """The kernel set's context of a forward over `positions` (rows x new tokens), entered
        while the forward is built and evaluated: the fused forward's (engines/kernels.py:
        ForwardContext), nothing for mlx-lm's."""
        return nullcontext() if self.fused is None else self.fused.k.context(positions)

    def _head(self, hidden: mx.array) -> mx.array:
        """The model's own output projection over hidden [..., dim], as the kernel set runs it
        (mlx-lm's forward with a plain head)."""
        return self.kernels.functions.mlx_lm_head(*output_head(self.model), hidden)

    def plan(self, rows: list[int], starts: list[int], q: int) -> ForwardPlan:
        """Where `rows` write q positions each from `starts` (the store grown to hold them)."""
        store = self.table.store
        kv_len = max(starts) + q
        store.ensure_rows(max(rows) + 1)  # a scoring row allocates the scoring rows
        store.ensure(kv_len)
        return ForwardPlan(
            rows=rows,
            starts=starts,
            length=q,
            mask=row_mask(starts, q, kv_len),
            kv_len=kv_len,
            all_rows=rows == list(range(store.rows)),
            group_axis=self.grouped_scores,
        )

    def graph(
        self, rows: list[int], starts: list[int], ids: mx.array, context, every: bool = False
    ) -> mx.array:
        """The (lazy) logits [B, vocab] float32 of each row's last position for ids [B, q]
        (`every`: of each position of the one row, [q, vocab]; see `speculative`); `context`:
        the step's (`context`)."""
        table = self.table
        if every:
            plan = self.plan(rows, starts, ids.shape[1])
            views = row_views(self.layout, table.store, table.states, plan)
            hidden = self.model.model(ids, cache=views)[0]
            return self._head(hidden).astype(mx.float32)
        if table.serial_cache is not None:  # one row on mlx-lm's own caches
            return last_logits(self.model, self.inner, ids, table.serial_cache).astype(mx.float32)
        plan = self.plan(rows, starts, ids.shape[1])
        views = row_views(self.layout, table.store, table.states, plan)
        if self.fused is not None:
            logits = self.fused.logits(ids, views, context)
        elif self.plain_head:
            hidden = self.model.model(ids, cache=views)[:, -1, :]
            logits = self._head(hidden)
        else:  # the model's own head: soft-capping, scaled or tied embeddings...
            logits = last_logits(self.model, self.inner, ids, views)
        return logits.astype(mx.float32)

    def run_groups(self, groups: list[Group], every: frozenset[int] = frozenset()) -> np.ndarray:
        """Logits [rows, vocab] (numpy) of each group row's last position (every position of
        the groups in `every`, row by row; the unfused forward gets only one-row groups
        there), evaluated now."""
        table = self.table
        positions = sum(len(rows) * len(toks[0]) for rows, _, toks in groups)
        context = self.context(positions)
        with context:
            # the store grows before any group's views are made: every view reads the same arrays
            table.store.ensure_rows(max(max(r) for r, _, _ in groups) + 1)
            table.store.ensure(max(max(s) + len(t[0]) for _, s, t in groups))
            if self.fused is not None:
                parts = []
                for rows, starts, toks in groups:
                    ids = mx.array(np.asarray(toks, dtype=np.int32))
                    plan = self.plan(rows, starts, ids.shape[1])
                    views = row_views(self.layout, table.store, table.states, plan)
                    parts.append((ids, views, starts, plan.mask))
                logits = self.fused.forward_groups(parts, context, every).astype(mx.float32)
            else:
                parts = []
                for g, (rows, starts, t) in enumerate(groups):
                    ids = mx.array(np.asarray(t, dtype=np.int32))
                    parts.append(self.graph(rows, starts, ids, context, g in every))
                    if self.stage is not None:
                        # a pipeline stage evaluates one group's transfers at a time: MLX may
                        # order independent graphs differently on each rank, and the ring's
                        # messages carry no tags to pair them up
                        mx.eval(parts[-1], *table.held())
                logits = mx.concatenate(parts)
            mx.eval(logits, *table.held())
        return np.array(logits, copy=False)
