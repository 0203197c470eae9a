"""The batch scheduler: one thread owns the engine and advances every running row together.

Once per step boundary (`step()`):
  1. serve exclusive leases (the batch is paused while one is held, S6);
  2. plan the step (planner.plan, pure): rows to retire, queued requests to drop or admit (FIFO),
     decode rows, prompt chunks and scoring chunks under the `--step-tokens` budget, whether a
     pump runs;
  3. apply its bookkeeping: retire, drop, give admitted requests their rows;
  4. run its forward (`engine.run`, or the pipeline for greedy decode-only steps) and commit:
     sample per row, emit, retire rows that hit EOS, a stop sequence or their limit; scoring
     chunks' log-probabilities go to the scorer (executor.py);
  5. let a pump (embeddings; the session scorer fallback) run one chunk on its session (C1).
An idle scheduler sleeps on a condition variable, so a lone request starts at once (S7).

A request whose prompt cannot open its row because the memory budget refuses its KV (nothing
emitted yet) waits for room instead of failing (`_park`): it gives its row back and is queued
again at its place, passed over by admission until a row of this scheduler is freed or
MEMORY_RETRY_S pass (another model may have gone idle: the budget evicts it on the retry),
and fails with the budget's numbers (503, Retry-After) once `memory_wait` seconds have passed
since its first refusal. A growth refused while a row decodes still fails that request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llm_server.decoding import FinishReason
from llm_server.engines.contract import Engine
from llm_server.engines.kv.budget import REFUSED
from llm_server.engines.plan import StepPlan
from llm_server.scheduler.drafting import drafts, prediction_usage
from llm_server.scheduler.executor import PlanExecutor
from llm_server.scheduler.lease import Lease
from llm_server.scheduler.pipelining import Pipeline
from llm_server.scheduler.planner import plan
from llm_server.scheduler.pumps import Pump
from llm_server.scheduler.request import (
    FinishEvent,
    GenerationRequest,
    Priority,
    QueueFull,
    SchedulerClosed,
)
from llm_server.scheduler.scorer import Scorer
from llm_server.scheduler.spec_policy import StepCosts

log = logging.getLogger(__name__)

# the default --step-tokens: positions per forward (decode rows + prompt chunks); measured on
# SmolLM2 (docs/ARCHITECTURE.md "Step budget")
DEFAULT_STEP_TOKENS = 128
# positions per forward when no row decodes (a lone long prompt; issue 38): nobody waits on the
# step, so a prompt runs at the machine's prefill rate; bounded as the engine bounds a session
# prefill's activation memory (measured: llm_server/benchmark/prefill_rate.py, docs/performance.md)
DEFAULT_PREFILL_TOKENS = 512
# --speculative / --spec-tokens defaults (scheduler/drafting.py; measured in docs/performance.md, "Speculative decoding")
DEFAULT_SPECULATIVE = "ngram"
DEFAULT_SPEC_TOKENS = 8
# seconds without an interactive request before batch lines take rows again (S11, yielding):
# a client's next request usually follows its answer within this, and a line admitted in the
# gap would only give its row back at once
BATCH_IDLE_S = 0.2
# seconds a request refused room for its prompt's KV waits for room before its 503 (the
# service's `memory_wait`), and between its retries when no row of this scheduler is freed
DEFAULT_MEMORY_WAIT_S = 30.0
MEMORY_RETRY_S = 1.0


@dataclass(frozen=True)
class SchedulerStats:
    rows: int  # rows in use for serving (the --concurrent-requests value)
    rows_busy: int
    queued: int
    decode_steps: int
    max_rows_busy: int  # high-water mark since start
    last_error: str | None
    drafted_tokens: int = 0  # speculative draft ids verified since start
    accepted_tokens: int = 0  # of those, the ones that matched the greedy choice
    generated_tokens: int = 0  # tokens emitted to requests since start


class BatchScheduler:
    """Serves generation requests on `max_concurrent` rows of one engine (S1-S8)."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        max_concurrent: int = 1,
        max_queued: int = 16,
        retry_after: float = 1.0,
        on_step: Callable[[float, int], None] | None = None,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        speculative: str = DEFAULT_SPECULATIVE,
        spec_tokens: int = DEFAULT_SPEC_TOKENS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        batch_share: bool = False,
        memory_wait: float = DEFAULT_MEMORY_WAIT_S,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        if max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self._factory = engine_factory
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.retry_after = retry_after
        if not memory_wait >= 0:
            raise ValueError("memory_wait must be >= 0 seconds")
        # seconds a request refused room for its prompt's KV waits for room (`_park`)
        self.memory_wait = memory_wait
        self.memory_waits = 0  # times a request was queued again to wait for room
        self._freed_at = float("-inf")  # time.monotonic() a row was last freed
        # called after every forward with (seconds, rows in it), on the scheduler thread
        self._step_listeners: list[Callable[[float, int], None]] = [on_step] if on_step else []
        # positions per forward, decode rows included (0: whole prompts, as before issue 17)
        self.step_tokens = step_tokens
        # positions per forward when no row decodes (planner rule 3; 0: unlimited)
        self.prefill_tokens = prefill_tokens
        if speculative not in ("ngram", "off"):
            raise ValueError("speculative must be 'ngram' or 'off'")
        if spec_tokens < 0:
            raise ValueError("spec_tokens must be >= 0")
        # prompt-lookup drafts of up to spec_tokens ids per greedy row (drafting.py)
        self.speculative = speculative
        self.spec_tokens = spec_tokens
        # tests: request -> the draft to verify (replaces prompt lookup and its back-off)
        self.draft_hook: Callable[[GenerationRequest], tuple[int, ...]] | None = None
        self.spec_costs = StepCosts()  # measured step costs and acceptance (spec_policy.py)
        self.engine: Engine | None = None
        self.pump: Pump | None = None
        self.scorer: Scorer | None = None  # its prompts ride in the plans on scoring rows
        self._cond = threading.Condition()
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._running: dict[int, GenerationRequest] = {}
        self._free: list[int] = []
        self._leases: collections.deque[Lease] = collections.deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.max_rows_busy = 0
        self.preempted = 0  # batch lines that gave their row to an interactive request (S11)
        # S11: False (yield): batch lines run only while no interactive request does; True
        # (share): they keep decoding beside interactive requests in rows nobody waits for
        self.batch_share = batch_share
        self._interactive_at = float("-inf")  # time.monotonic() an interactive one was seen
        # the latest request seq numbers in admission order (tests check FIFO); bounded so a
        # daemon running for days does not grow it
        self.admitted: collections.deque[int] = collections.deque(maxlen=4096)
        self._pipeline = Pipeline()  # the next decode step, started early (pipelined engines)
        # runs each plan's forward and commits it (executor.py)
        self.executor = PlanExecutor(
            self._running,
            self._retire,
            self._may_speculate,
            self._pipeline,
            self.spec_costs,
            self._step_listeners,
            self._park,
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> BatchScheduler:
        self._thread = threading.Thread(target=self._main, name="llm-scheduler", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> Engine:
        """Block until the engine is loaded; re-raise its load error."""
        if not self.ready.wait(timeout):
            raise TimeoutError("the model did not finish loading in time")
        if self.load_error is not None:
            raise self.load_error
        assert self.engine is not None
        return self.engine

    def close(self, timeout: float | None = None) -> bool:
        """Stop admitting; let running and queued requests finish; True if the thread ended."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def abort(self) -> None:
        """Cancel everything running or queued (second SIGTERM, tests)."""
        with self._cond:
            for req in [*self._queue, *self._running.values()]:
                req.cancelled.set()
            self._cond.notify_all()

    def fail_all(self, error: str) -> None:
        """Finish every queued and running request with `error` (the API answers 503), from any
        thread. Only for a scheduler thread stuck in a hung step: rows are not released and the
        stuck thread emits nothing any more."""
        with self._cond:
            reqs = [*self._queue, *self._running.values()]
        for req in reqs:
            self._finish(req, FinishReason.ERROR, error)

    # -- admission (any thread) ------------------------------------------------------

    def submit(self, req: GenerationRequest) -> None:
        """Admit `req` at once or raise QueueFull/SchedulerClosed (S3)."""
        self.submit_all([req])

    def submit_all(self, reqs: list[GenerationRequest]) -> None:
        """Admit every request of `reqs` (the choices of one HTTP request) or none of them.
        A request's embedding spans are checked against the loaded engine first
        (`Engine.check_spans`: EmbeddingInputUnsupported, ValueError)."""
        if self.engine is not None:
            for req in reqs:
                if req.embeddings:
                    self.engine.check_spans(len(req.prompt), req.embeddings)
        with self._cond:
            if self._closing or self.load_error is not None:
                raise SchedulerClosed("the server is shutting down")
            interactive = [r for r in reqs if r.priority is Priority.INTERACTIVE]
            if interactive:
                # batch lines hold rows on loan (S11): only interactive requests count
                running = sum(r.priority is Priority.INTERACTIVE for r in self._running.values())
                waiting = self._interactive_waiting()
                if running + waiting + len(interactive) > self.max_concurrent + self.max_queued:
                    raise QueueFull(running, waiting, self.retry_after)
            for req in reqs:
                req._wake = self.wake
                self._enqueue(req)
            self._cond.notify_all()

    def _enqueue(self, req: GenerationRequest) -> None:
        """Append `req`; an interactive request goes ahead of every queued batch line, and a
        preempted batch line ahead of the other batch lines (S11)."""
        if req.priority is Priority.BATCH and not req.resumed_tokens:
            self._queue.append(req)
            return
        first_batch = next(
            (i for i, r in enumerate(self._queue) if r.priority is Priority.BATCH), None
        )
        if first_batch is None:
            self._queue.append(req)
        else:
            self._queue.insert(first_batch, req)

    def _interactive_waiting(self) -> int:
        return sum(r.priority is Priority.INTERACTIVE for r in self._queue)

    def interactive_waiting(self) -> int:
        """Interactive requests queued for a row now (the Batch API waits while any is)."""
        with self._cond:
            return self._interactive_waiting()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def add_step_listener(self, listener: Callable[[float, int], None]) -> None:
        """Call `listener(seconds, rows)` after every forward (metrics, benchmarks); it runs on
        the scheduler thread and must not block."""
        self._step_listeners.append(listener)

    def lease(self) -> Lease:
        """Queue an exclusive lease; wait on `lease.granted` (FIFO among holders)."""
        lease = Lease(self.wake)
        with self._cond:
            self._leases.append(lease)
            self._cond.notify_all()
        return lease

    def acquire_lease(self, timeout: float | None = None) -> Lease:
        """Blocking form: returns a granted lease (use it as a context manager)."""
        lease = self.lease()
        try:
            lease.granted.result(timeout)
        except BaseException:
            lease.release()
            raise
        return lease

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(
                rows=self.max_concurrent,
                rows_busy=len(self._running),
                queued=len(self._queue),
                decode_steps=self.decode_steps,
                max_rows_busy=self.max_rows_busy,
                last_error=self.last_error,
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
                generated_tokens=self.executor.generated_tokens,
            )

    @property
    def decode_steps(self) -> int:
        return self.executor.decode_steps

    @property
    def drafted_tokens(self) -> int:
        return self.executor.drafted_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.executor.accepted_tokens

    @property
    def last_error(self) -> str | None:
        return self.executor.last_error

    @property
    def step_trace(self) -> list[tuple[int, ...]] | None:
        """Each forward's request seqs, once set to [] (tests)."""
        return self.executor.step_trace

    @step_trace.setter
    def step_trace(self, trace: list[tuple[int, ...]] | None) -> None:
        self.executor.step_trace = trace

    @property
    def speculated_steps(self) -> int:
        return self._pipeline.used

    @property
    def dropped_speculations(self) -> int:
        return self._pipeline.dropped

    def idle(self) -> bool:
        with self._cond:
            return not self._running and not self._queue

    # -- the scheduler thread --------------------------------------------------------

    def _main(self) -> None:
        try:
            self.load()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready/health
            self.load_error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            while self._wait_for_work():
                self.step()
        finally:
            self._pipeline.drop(self.engine)  # leave nothing computing when the thread ends
            self.engine.thread_exit()

    def load(self) -> None:
        """Make the engine and decide the row count (S1: fewer rows than asked, one warning)."""
        self.engine = self._factory()
        rows = min(self.max_concurrent, self.engine.rows)
        if rows < self.max_concurrent:
            log.warning(
                "serving %d request(s) at a time instead of %d: %s",
                rows,
                self.max_concurrent,
                self.engine.serial_reason
                or f"the model does not support batching ({self.engine.rows} row(s) in its graph)",
            )
            self.max_concurrent = rows
        self._free = list(range(rows))
        self.executor.engine = self.engine
        self.executor.scorer = self.scorer
        if self.scorer is not None:
            self.scorer.attach(self.engine)  # scoring rows, or the session fallback

    def step(self) -> StepPlan:
        """One step boundary on the calling thread (the scheduler thread; tests drive it
        directly): serve leases (S6), plan, apply the plan's bookkeeping, run its forward and
        commit it, then let a pump run (C1). Returns the plan it executed."""
        self._serve_leases()
        self._preempt()
        step = self._plan()
        if not (step.forward or step.pump or step.retire or step.drop or step.admit):
            self._hold_batch()  # only held-back batch lines are left: no busy loop
        self._apply(step)
        if step.forward:
            self.executor.execute(step)
        if step.pump and self.pump is not None:
            self._pipeline.drop(self.engine)
            self.pump.run_batch(self.engine)
        return step

    def _has_work(self) -> bool:
        return bool(
            self._running
            or self._leases
            or any(not self._waiting(r) for r in self._queue)
            or self._side_work()
        )

    def _waiting(self, req: GenerationRequest) -> bool:
        """`req` waits for room in the memory budget and none may have appeared since it was
        refused (no row freed, its retry not due; a closing scheduler or a cancel ends it)."""
        parked = req.memory_parked_at
        if parked is None or self._closing or req.cancelled.is_set():
            return False
        return self._freed_at <= parked and time.monotonic() < req.memory_retry_at

    def _next_retry(self) -> float | None:
        """Seconds until the first request waiting for room retries (None: none waits)."""
        due = [r.memory_retry_at for r in self._queue if r.memory_parked_at is not None]
        return max(min(due) - time.monotonic(), 0.0) if due else None

    def _side_work(self) -> bool:
        """A pump or the scorer has work (scoring rows ride in the plans, pumps after them)."""
        pumped = self.pump is not None and self.pump.pending()
        return pumped or (self.scorer is not None and self.scorer.pending())

    def _wait_for_work(self) -> bool:
        """Block until there is work (True) or the scheduler closes (False); meanwhile give
        the engine's idle KV memory back when its keep-alive is over (`trim_idle`)."""
        due = self.engine.idle_due
        while True:
            with self._cond:
                if self._has_work():
                    return True
                if self._closing:
                    return False
                left = due()
                if left is None or left > 0:
                    retry = self._next_retry()
                    if retry is not None:
                        left = retry if left is None else min(left, retry)
                    self._cond.wait(left)
                    continue
            self.engine.trim_idle()  # outside the lock: submitters never wait on it

    def _serve_leases(self) -> None:
        if self._leases:
            self._pipeline.drop(self.engine)  # the holder drives the engine itself
        while True:
            with self._cond:
                if not self._leases:
                    return
                lease = self._leases.popleft()
            if lease.released.is_set():
                continue  # abandoned before it was granted
            lease.granted.set_result(None)
            self._hold(lease)

    def _hold(self, lease: Lease) -> None:
        """Run the holder's calls until it releases; no decode step runs meanwhile (S6)."""
        while True:
            for fn, fut in lease.take_calls():
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as exc:  # noqa: BLE001 - handed to the holder
                        fut.set_exception(exc)
            with self._cond:
                if lease.released.is_set() and not lease.calls:
                    return
                if not lease.calls:
                    self._cond.wait(timeout=1.0)

    def _interactive(self) -> bool:
        """An interactive request runs or waits (under the lock); notes when one was seen."""
        seen = self._interactive_waiting() > 0 or any(
            r.priority is Priority.INTERACTIVE for r in self._running.values()
        )
        if seen:
            self._interactive_at = time.monotonic()
        return seen

    def _batch_admissible(self) -> bool:
        """May batch lines take rows now (S11)? Sharing: yes, behind the interactive ones in
        the queue; yielding: only BATCH_IDLE_S after the last interactive request."""
        with self._cond:
            busy = self._interactive()
        if self.batch_share:
            return True
        return not busy and time.monotonic() - self._interactive_at >= BATCH_IDLE_S

    def _hold_batch(self) -> None:
        """Wait out the rest of BATCH_IDLE_S (a submit or cancel wakes it sooner)."""
        left = BATCH_IDLE_S - (time.monotonic() - self._interactive_at)
        with self._cond:
            if left > 0 and any(r.priority is Priority.BATCH for r in self._queue):
                self._cond.wait(left)

    def _preempt(self) -> None:
        """S11: interactive requests take the rows of running batch lines (yielding: every
        line's while any interactive request runs or waits; sharing: the newest lines', as many
        as wait with no row free). A line goes back to the head of the batch lines with its
        output appended to its prompt (the release hands the row's tokens to the prefix
        cache)."""
        with self._cond:
            if self.batch_share:
                waiting = self._interactive_waiting() - len(self._free)
            else:
                waiting = self.max_concurrent if self._interactive() else 0
            if waiting <= 0:
                return
            lines = [
                r
                for r in self._running.values()
                if r.priority is Priority.BATCH and not r.exclusive and not r.cancelled.is_set()
            ]
        victims = sorted(lines, key=lambda r: r.seq, reverse=True)[:waiting]
        if not victims:
            return
        self._pipeline.drop(self.engine)  # an early step for these rows must not land
        for req in victims:
            row = req.row
            try:
                self.engine.release(row)
            finally:
                with self._cond:
                    del self._running[row]
                    self._free.append(row)
                    self._freed_at = time.monotonic()  # (its KV may be the room one waits for)
            output = list(req.decoder.tokens)
            req.prompt = [*req.prompt[: req.prompt_tokens], *output]
            req.resumed_tokens = len(output)
            req.row, req.prefilled = None, 0
            with self._cond:
                self._enqueue(req)
            self.preempted += 1

    def _plan(self) -> StepPlan:
        """The next step (planner.plan) on a consistent view of the queue and the rows."""
        in_flight = self._pipeline.pending_for(self._running, self.engine)
        step_drafts = self._drafts()
        if in_flight and step_drafts:
            # the early step is plain decoding and cannot verify a draft: a draft the policy
            # says pays goes first (its measured step time carries the dropped step's cost)
            self._pipeline.drop(self.engine)
            in_flight = False
        scoring = () if self.scorer is None else self.scorer.open_prompts(self.engine)
        admit_batch = self._batch_admissible()
        with self._cond:
            return plan(
                self._queue,
                self._running,
                self._free,
                self.step_tokens,
                admit=not in_flight,  # the step in flight is for the current rows
                pump=self.pump is not None and self.pump.pending() and not self._leases,
                share_min=self.engine.shared_prefix_min,
                drafts=step_drafts,
                scoring=() if self._leases else scoring,
                prefill_budget=self.prefill_tokens,
                row_for=self.engine.preferred_row,
                admit_batch=admit_batch,
                waiting=self._waiting,
            )

    def _may_speculate(self) -> bool:
        """Nothing to admit, prefill, lease or score at the next step boundary."""
        return not (
            any(not self._waiting(r) for r in self._queue)
            or self._leases
            or self._side_work()
            or any(r.prefilled < len(r.prompt) for r in self._running.values())
        )

    def _drafts(self) -> dict[int, tuple[int, ...]]:
        """Each decoding row's draft for the next step (drafting.py): prompt lookup under
        `--speculative ngram`, a request's `prediction` in any mode; {} when none applies."""
        if self.spec_tokens <= 0 or not self.engine.speculative:
            return {}
        lookup = self.speculative == "ngram"
        if not (lookup or self.draft_hook or any(r.prediction for r in self._running.values())):
            return {}
        return drafts(self._running, self.spec_tokens, self.spec_costs, lookup, self.draft_hook)

    def _apply(self, step: StepPlan) -> None:
        """The plan's bookkeeping before its forward: retire, drop, admit (S2, S3, S5)."""
        for row in step.retire:
            self._retire(self._running[row], FinishReason.CANCELLED)
        gone = {*step.drop, *(a.seq for a in step.admit)}
        if not gone:  # most decode steps: leave the queue as it is
            return
        with self._cond:
            taken = {r.seq: r for r in self._queue if r.seq in gone}
            self._queue = collections.deque(r for r in self._queue if r.seq not in gone)
        for seq in step.drop:
            self._finish(taken[seq], FinishReason.CANCELLED)
        for adm in step.admit:
            req = taken[adm.seq]
            with self._cond:
                self._free.remove(adm.row)
                req.row = adm.row
                self._running[adm.row] = req
                self.max_rows_busy = max(self.max_rows_busy, len(self._running))
                self.admitted.append(req.seq)
            req.started_at = time.monotonic()
            if adm.exclusive:
                self.executor.run_exclusive(req)

    def _retire(
        self, req: GenerationRequest, reason: FinishReason, error: str | None = None
    ) -> None:
        row = req.row
        if row is not None and self._running.get(row) is req:
            try:
                self.engine.release(row)
            finally:
                with self._cond:
                    del self._running[row]
                    self._free.append(row)
                    self._freed_at = time.monotonic()  # room for a request waiting for it
        self._finish(req, reason, error)

    def _park(self, req: GenerationRequest, exc: BaseException) -> bool:
        """`req`'s prompt could not open its row (`exc`): when the memory budget refused its
        KV and it has waited less than `memory_wait`, give its row back and queue it again at
        the head of its priority, to retry once room may have appeared; True when it did. A
        store kept idle (no other row busy) is given back first: it is the room it needs."""
        if REFUSED not in str(exc) or req.decoder.tokens or req.cancelled.is_set():
            return False
        now = time.monotonic()
        if req.memory_deadline is None:
            req.memory_deadline = now + self.memory_wait
        if self._closing or now >= req.memory_deadline:
            return False
        row = req.row
        if row is not None and self._running.get(row) is req:
            try:
                self.engine.release(row)
            finally:
                with self._cond:
                    del self._running[row]
                    self._free.append(row)
        req.row, req.prefilled, req.cached_tokens, req.started_at = None, 0, 0, None
        retry = now + MEMORY_RETRY_S
        if self.engine.trim_idle(force=True):  # (False while another row is busy)
            retry = now  # the idle store was in the way: retry at once
        req.memory_parked_at = now
        req.memory_retry_at = min(retry, req.memory_deadline)
        with self._cond:
            if req.priority is Priority.INTERACTIVE:
                self._queue.appendleft(req)
            else:
                first_batch = next(
                    (i for i, r in enumerate(self._queue) if r.priority is Priority.BATCH),
                    len(self._queue),
                )
                self._queue.insert(first_batch, req)
        self.memory_waits += 1
        log.info(
            "request %d waits for room in the memory budget (up to %.1fs more): %s",
            req.seq,
            req.memory_deadline - now,
            exc,
        )
        return True

    def _finish(
        self, req: GenerationRequest, reason: FinishReason, error: str | None = None
    ) -> None:
        req.emit(
            FinishEvent(
                reason=reason,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=len(req.decoder.tokens),
                timings=req.timings(),
                error=error,
                cached_tokens=req.cached_tokens,
                prediction=prediction_usage(req),
            )
        )
