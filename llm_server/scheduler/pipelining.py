"""Pipelined greedy decoding: step n+1 is built and started while step n computes.

When every running row decodes greedily with nothing else waiting, the scheduler starts the
next step on the lazy argmax ids of the current one before the current one is finished, so
building the graph and the per-row work (sampling, detokenizing, streaming) overlap the
forward. The early step is used only when it is exactly the step that would have run: the same
requests (minus retired ones) and the token each sampler picked. Engines opt in with
`pipelined` (MLX on Metal by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from llm_server.engines.contract import DecodeStep, PipelinedEngine
from llm_server.scheduler.request import GenerationRequest


@dataclass(frozen=True)
class _Speculation:
    reqs: list[GenerationRequest]  # the requests of `step`, in row order
    step: DecodeStep  # the engine's started step (on the lazy ids of `base`)
    base: DecodeStep  # the step whose greedy ids it assumed


def greedy_plain(req: GenerationRequest) -> bool:
    """Whether the request's next token is the argmax of its logits (nothing reshapes them)."""
    return (
        not req.exclusive
        and req.decoder.constraint is None
        and req.decoder.params.plain_greedy
        and not req.cancelled.is_set()
    )


class Pipeline:
    """The decode step started early, and the rules for using or dropping it."""

    def __init__(self) -> None:
        self._spec: _Speculation | None = None
        self.used = 0  # decode steps that were started before the one before had ended
        self.dropped = 0  # started early, then not the step that had to run

    def pending_for(
        self, running: Mapping[int, GenerationRequest], engine: PipelinedEngine
    ) -> bool:
        """Whether a step is in flight for live rows (newcomers then wait for it); a step
        whose rows were all retired meanwhile is dropped."""
        if self._spec is None:
            return False
        if any(running.get(r.row) is r for r in self._spec.reqs):
            return True
        self.drop(engine)
        return False

    def step(
        self,
        engine: PipelinedEngine,
        reqs: list[GenerationRequest],
        running: Mapping[int, GenerationRequest],
        may_speculate: bool,
    ) -> tuple[list[GenerationRequest], np.ndarray]:
        """Run one decode step for `reqs` (the early one when it fits); start the next early
        when `may_speculate` and every row is greedy. Returns the step's requests and logits."""
        spec, self._spec = self._spec, None
        if spec is not None and [r for r in spec.reqs if running.get(r.row) is r] == reqs:
            step, step_reqs = spec.step, spec.reqs
            self.used += 1
        else:
            if spec is not None:
                engine.decode_cancel(spec.step)
                self.dropped += 1
            step_reqs = reqs
            step = engine.decode_start([r.row for r in reqs], [r.last_token for r in reqs])
        if step_reqs == reqs and may_speculate and all(greedy_plain(r) for r in reqs):
            try:
                nxt = engine.decode_start(step.rows, step.greedy)
            except Exception:
                engine.decode_cancel(step)
                raise
            self._spec = _Speculation(reqs, nxt, step)
        return step_reqs, engine.decode_finish(step)

    def check(self, running: Mapping[int, GenerationRequest], engine: PipelinedEngine) -> None:
        """After the rows advanced: drop the early step unless every live row picked the token
        it assumed."""
        spec = self._spec
        if spec is None:
            return
        ids = np.array(spec.base.greedy).reshape(-1)
        live = [
            (req, int(t))
            for req, t in zip(spec.reqs, ids, strict=True)
            if running.get(req.row) is req
        ]
        if not live or any(req.last_token != t for req, t in live):
            self.drop(engine)

    def drop(self, engine: PipelinedEngine) -> None:
        if self._spec is not None:
            spec, self._spec = self._spec, None
            engine.decode_cancel(spec.step)
            self.dropped += 1
