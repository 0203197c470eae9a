"""The MLX engine's forward over its rows: groups of rows at their cursors -> logits.

A group is rows that take the same number of new positions (the decode rows at q=1, a prompt
chunk, a drafted row's pending token and draft, a scoring chunk). On the fused layers every
group of a step shares one packed forward (`FusedForward.forward_groups`); other models build
one graph per group over views of the same row store and state slots (layout.row_views), and
they are evaluated together. A model served serially runs on mlx-lm's caches of its one row.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import EmbeddingInputUnsupported
from llm_server.engines.forward.fused import FusedForward, GroupViews, with_inputs
from llm_server.engines.forward.kernels import KernelSet
from llm_server.engines.kv.rows import RowTable
from llm_server.engines.kv.store import ForwardPlan, row_mask
from llm_server.engines.mlx.layout import Layout, last_logits, output_head, row_views


class RowGroup(NamedTuple):
    """What the engine asks of one group: rows that take the same number of new positions.
    The forward turns it into its own `Group` (engines/forward/layers.py) over the rows'
    views (`GroupViews`)."""

    rows: list[int]
    starts: list[int]  # each row's cursor: where its new positions go
    ids: list[list[int]]  # each row's new ids (one length for all)


# a one-row group's input embeddings: (offset in its positions, rows [n, hidden]) in order,
# taking the place of the token embeddings there (engines/plan.py: EmbeddingSpan)
Inputs = list[tuple[int, Any]]


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
        # why this forward cannot take input embeddings (None: it can)
        self.inputs_problem = _inputs_problem(model, fused, stage)

    def check_inputs(self) -> None:
        """EmbeddingInputUnsupported unless this forward takes input embeddings."""
        if self.inputs_problem is not None:
            raise EmbeddingInputUnsupported(
                f"the model's forward cannot take embeddings ({self.inputs_problem})"
            )

    def context(self, positions: int) -> AbstractContextManager:
        """The kernel set's context of a forward over `positions` (rows x new tokens), entered
        while the forward is built and evaluated: the fused forward's (engines/forward/kernels.py:
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
        self,
        rows: list[int],
        starts: list[int],
        ids: mx.array,
        context,
        every: bool = False,
        inputs: list[tuple[int, mx.array]] | None = None,
    ) -> mx.array:
        """The (lazy) logits [B, vocab] float32 of each row's last position for ids [B, q]
        (`every`: of each position of the one row, [q, vocab], through the plain head or the
        model's own; see `MLXEngine.speculative`); `context`:
        the step's (`context`); `inputs`: the one row's input embeddings (mlx-lm's
        `input_embeddings`; unfused forward only)."""
        table = self.table
        kw = {} if not inputs else {"input_embeddings": self._embedded(ids, inputs)}
        if every:
            plan = self.plan(rows, starts, ids.shape[1])
            views = row_views(self.layout, table.store, table.states, plan)
            if not self.plain_head:  # the model's own head, over every position
                return self.model(ids, cache=views, **kw)[0].astype(mx.float32)
            hidden = self.model.model(ids, cache=views, **kw)[0]
            return self._head(hidden).astype(mx.float32)
        if table.serial_cache is not None:  # one row on mlx-lm's own caches
            logits = last_logits(self.model, self.inner, ids, table.serial_cache, **kw)
            return logits.astype(mx.float32)
        plan = self.plan(rows, starts, ids.shape[1])
        views = row_views(self.layout, table.store, table.states, plan)
        if self.fused is not None:
            logits = self.fused.logits(ids, views, context)
        elif self.plain_head:
            hidden = self.model.model(ids, cache=views, **kw)[:, -1, :]
            logits = self._head(hidden)
        else:  # the model's own head: soft-capping, scaled or tied embeddings...
            logits = last_logits(self.model, self.inner, ids, views, **kw)
        return logits.astype(mx.float32)

    def _embedded(self, ids: mx.array, inputs: list[tuple[int, mx.array]]) -> mx.array:
        """mlx-lm's `input_embeddings` [1, q, hidden] for one row's ids [1, q]: the token
        embeddings with `inputs` in their place."""
        return with_inputs(self.model.model.embed_tokens(ids[0]), inputs)[None]

    def run_groups(
        self,
        groups: list[RowGroup],
        every: frozenset[int] = frozenset(),
        inputs: dict[int, Inputs] | None = None,
    ) -> np.ndarray:
        """Logits [rows, vocab] (numpy) of each group row's last position (every position of
        the groups in `every`, row by row; the unfused forward gets only one-row groups
        there), evaluated now. `inputs`: one-row group index -> its input embeddings."""
        table = self.table
        rows_in = {
            g: tuple((off, r if isinstance(r, mx.array) else mx.array(r)) for off, r in spans)
            for g, spans in (inputs or {}).items()
            if spans
        }
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
                    parts.append(GroupViews(ids, views, starts, plan.mask))
                extra = {"inputs": rows_in} if rows_in else {}  # (the keyword only when used)
                logits = self.fused.forward_groups(parts, context, every, **extra)
                logits = logits.astype(mx.float32)
            else:
                parts = []
                for g, (rows, starts, t) in enumerate(groups):
                    ids = mx.array(np.asarray(t, dtype=np.int32))
                    parts.append(self.graph(rows, starts, ids, context, g in every, rows_in.get(g)))
                    if self.stage is not None:
                        # a pipeline stage evaluates one group's transfers at a time: MLX may
                        # order independent graphs differently on each rank, and the ring's
                        # messages carry no tags to pair them up
                        mx.eval(parts[-1], *table.held())
                logits = mx.concatenate(parts)
            mx.eval(logits, *table.held())
        return np.array(logits, copy=False)


def _inputs_problem(model: Any, fused: FusedForward | None, stage: Any) -> str | None:
    """Why a forward cannot take input embeddings (None: it can): the fused layers always
    can; mlx-lm's model only when it and its decoder stack take `input_embeddings` and the
    stack has `embed_tokens`; a pipeline stage never (its ranks see token ids only)."""
    if stage is not None:
        return "split over ranks"
    if fused is not None:
        return None
    stack = getattr(model, "model", None)
    if getattr(stack, "embed_tokens", None) is None:
        return f"{type(model).__module__}: no token embedding table at model.model.embed_tokens"
    for fn in (type(model).__call__, type(stack).__call__):
        if "input_embeddings" not in inspect.signature(fn).parameters:
            return f"{type(model).__module__}: mlx-lm's forward has no input_embeddings"
    return None
