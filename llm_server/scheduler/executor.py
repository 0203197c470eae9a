"""Executing a step plan on the scheduler thread: the forward, the per-request retry, commit.

A part `BatchScheduler` holds (the loop, the queue and the rows stay in batch.py): `execute`
runs the plan's forward through `engine.run`, or through the pipeline (pipelining.py) when the
plan only decodes and the engine is pipelined; a failed forward is retried per request (each
decode row, prompt chunk and scoring chunk alone) so the error stays with the request that
caused it (S8); `_commit` notes where prompts stand, samples, emits and retires per row, and
hands the scoring chunks' log-probabilities to the scorer. It reads the scheduler's running
rows (the same dict) and hands finished requests back through `retire`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from llm_server.decoding import FinishReason, StepOutput
from llm_server.engines.contract import Engine
from llm_server.engines.plan import StepPlan, StepResult
from llm_server.scheduler.pipelining import Pipeline
from llm_server.scheduler.request import GenerationRequest, TokenEvent
from llm_server.scheduler.scorer import Scorer
from llm_server.scheduler.spec_policy import StepCosts

# retire(request, reason, error): release the request's row and send its FinishEvent
Retire = Callable[[GenerationRequest, FinishReason, str | None], None]

log = logging.getLogger("llm_server.scheduler.batch")


class PlanExecutor:
    """Runs step plans on the engine and commits them: sampling, emitting, retiring."""

    def __init__(
        self,
        running: dict[int, GenerationRequest],
        retire: Retire,
        may_speculate: Callable[[], bool],
        pipeline: Pipeline,
        spec_costs: StepCosts,
        listeners: list[Callable[[float, int], None]],
        park: Callable[[GenerationRequest, BaseException], bool] | None = None,
    ) -> None:
        self._running = running  # row -> request: the scheduler's own dict, read here
        self._retire = retire
        self._may_speculate = may_speculate  # nothing else to run at the next boundary
        self._pipeline = pipeline
        self.spec_costs = spec_costs
        self._step_listeners = listeners  # (seconds, rows) after every forward
        # park(request, error) -> True when a request whose prompt could not open its row
        # (the memory budget refused the KV) was queued again to wait for room
        self._park = park
        self.engine: Engine | None = None  # given at load, with the scorer
        self.scorer: Scorer | None = None
        self.step_trace: list[tuple[int, ...]] | None = None  # [] records each forward's seqs
        self.decode_steps = 0
        self.drafted_tokens = 0  # draft ids verified
        self.accepted_tokens = 0  # draft ids kept
        self.generated_tokens = 0  # tokens emitted since start (the page's live tokens/s)
        self.last_error: str | None = None

    def run_exclusive(self, req: GenerationRequest) -> None:
        """Decode `req` alone to completion while the other rows wait (`--constrained-mode exclusive`)."""
        try:
            if req.embeddings:
                logits = self.engine.prefill(req.row, req.prompt, req.embeddings)
            else:
                logits = self.engine.prefill(req.row, req.prompt)
            req.prefilled = len(req.prompt)
            req.cached_tokens = self.engine.cached_tokens(req.row)
            while self._advance(req, logits):
                if req.cancelled.is_set():
                    self._retire(req, FinishReason.CANCELLED, None)
                    return
                logits = self.engine.decode([req.row], [req.last_token])[0]
        except Exception as exc:  # noqa: BLE001
            self._fail(req, exc, opening=req.first_token_at is None)

    def execute(self, step: StepPlan) -> None:
        """Run the plan's forward and commit it; a failed forward is retried per request so
        the error stays with the request that caused it (S8)."""
        step = self._live(step)
        if not step.forward:
            return
        if self.step_trace is not None:
            rows = (*step.decode_rows, *step.chunk_rows)
            self.step_trace.append(tuple(self._running[r].seq for r in rows))
        t0 = time.perf_counter()
        drafted = any(d.draft for d in step.decode)
        try:
            if self.engine.pipelined and not step.prefill and not step.score and not drafted:
                reqs = [self._running[d.row] for d in step.decode]
                step_reqs, logits = self._pipeline.step(
                    self.engine, reqs, self._running, self._may_speculate()
                )
                result = StepResult(tuple(r.row for r in step_reqs), logits)
                owners = {r.row: r for r in step_reqs}  # the step in flight may predate a retire
            else:
                self._pipeline.drop(self.engine)  # prompt chunks never ride a speculated step
                result, owners = self.engine.run(step), None
        except Exception as exc:  # noqa: BLE001 - retry per request so the error stays put (S8)
            self._pipeline.drop(self.engine)
            log.warning(
                "a step of %d positions failed (%s); retrying per request", step.tokens, exc
            )
            self.last_error = str(exc)
            for alone in (
                [StepPlan(decode=(d,)) for d in step.decode]
                + [StepPlan(prefill=(c,)) for c in step.prefill]
                + [StepPlan(score=(c,)) for c in step.score]
            ):
                try:
                    self._commit(alone, self.engine.run(alone))
                except Exception as row_exc:  # noqa: BLE001
                    if alone.score:
                        self.scorer.fail(self.engine, alone.score[0], row_exc)
                    else:
                        opening = bool(alone.prefill) and alone.prefill[0].fresh
                        req = self._running[(alone.decode or alone.prefill)[0].row]
                        self._fail(req, row_exc, opening)
        else:
            self._commit(step, result, owners)
            self._pipeline.check(self._running, self.engine)
            if not step.prefill and not step.score:
                # forward + commit: what a draft position costs (spec_policy)
                ids = sum(len(d.draft) for d in step.decode)
                self.spec_costs.observe(len(step.decode), ids, time.perf_counter() - t0)
        if step.decode:
            self.decode_steps += 1
        seconds = time.perf_counter() - t0
        rows = len(step.decode) + len(step.prefill) + len(step.score)
        for listener in self._step_listeners:
            listener(seconds, rows)

    def _live(self, step: StepPlan) -> StepPlan:
        """`step` without the rows an exclusive admission or a retirement has since freed."""
        decode = tuple(d for d in step.decode if d.row in self._running)
        chunks = tuple(
            c for c in step.prefill if getattr(self._running.get(c.row), "seq", None) == c.seq
        )
        if decode == step.decode and chunks == step.prefill:
            return step
        return dataclasses.replace(step, decode=decode, prefill=chunks)

    def _commit(
        self,
        step: StepPlan,
        result: StepResult,
        owners: dict[int, GenerationRequest] | None = None,
    ) -> None:
        """Note where prompts stand, sample each row's token, emit, retire the finished; the
        scoring chunks' log-probabilities go to the scorer."""
        if step.score:
            self.scorer.commit(self.engine, step.score, result.scores)
        for chunk in step.prefill:
            req = self._running[chunk.row]
            req.prefilled = result.cursors.get(chunk.row, len(req.prompt))
            if chunk.fresh and not req.resumed_tokens:  # the first prefill's count stands
                req.cached_tokens = result.cached.get(chunk.row, 0)
        reqs = owners or {r: self._running[r] for r in (*step.decode_rows, *step.chunk_rows)}
        drafts = {d.row: d.draft for d in step.decode if d.draft}
        for row, row_logits in zip(result.rows, result.logits, strict=True):
            req = reqs[row]
            if self._running.get(row) is not req:  # retired since the step started
                continue
            if row in result.verified:
                self._accept(req, row_logits, drafts[row], result.verified[row])
            else:
                self._advance(req, row_logits)

    def _accept(self, req: GenerationRequest, first, draft, verified) -> None:
        """Commit a verified draft: sample position by position exactly as plain decoding
        would (stop sequences, EOS and max_tokens end it where they fall), keep the draft ids
        the choices matched plus one token, and rewind the row past the rejected ones (before
        any retirement hands the row's tokens to the prefix cache)."""
        n = len(verified)
        base = self.engine.cursor(req.row) - n  # the cursor plain decoding would have now
        outs, kept, matched, error = [], 0, 0, None
        try:
            for i, logits in enumerate([first, *verified]):
                out = req.decoder.step(logits, self.engine.context_length - base - i)
                outs.append(out)
                hit = i < n and out.token_id == draft[i]
                matched += hit
                if out.finish is not None or not hit:
                    break
                kept += 1  # its position holds the right token: the row keeps it
        except Exception as exc:  # noqa: BLE001 - a decoding bug must not kill the thread
            error = exc
        # a finishing token is never fed back, as in plain decoding
        try:
            self.engine.rewind(req.row, base + kept)
        except Exception as exc:  # noqa: BLE001 - a stateful row's re-run failed: this row only (S8)
            self._fail(req, exc)
            return
        self.drafted_tokens += n
        self.accepted_tokens += matched
        if req.draft is not None:
            req.draft.note(n, matched, self.spec_costs)
        for out in outs:
            if not self._emit(req, out):
                return
        if error is not None:
            self._fail(req, error)

    def _advance(self, req: GenerationRequest, logits: Any) -> bool:
        """Sample from one row's logits and emit; returns True while the request continues."""
        room = self.engine.context_length - self.engine.cursor(req.row)
        try:
            out = req.decoder.step(logits, room)
        except Exception as exc:  # noqa: BLE001 - a decoding bug must not kill the thread
            self._fail(req, exc)
            return False
        return self._emit(req, out)

    def _emit(self, req: GenerationRequest, out: StepOutput) -> bool:
        """Emit one sampled token; retire the request when it finished. True: it continues."""
        req.last_token = out.token_id
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.emit(TokenEvent(out.token_id, out.text, out.logprob))
        self.generated_tokens += 1
        if out.finish is None:
            return True
        self._retire(req, out.finish, None)
        return False

    def _fail(self, req: GenerationRequest, exc: BaseException, opening: bool = False) -> None:
        """Retire `req` with `exc`; one whose prompt was `opening` its row (nothing emitted
        yet) may instead wait for room in the memory budget (`park`)."""
        if opening and self._park is not None and self._park(req, exc):
            return
        log.error("request %d failed: %s", req.seq, exc)
        self.last_error = str(exc)
        self._retire(req, FinishReason.ERROR, str(exc))
