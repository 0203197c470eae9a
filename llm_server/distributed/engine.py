"""Rank 0's engine: each call is broadcast to the followers, then run on the local shard.

Wraps the rank's `MLXEngine`; every member of the `Engine` protocol that only reads state
(cursors, sizes, names) goes straight to it. Calls that run a forward or change a row are sent first, so every rank runs
the same calls in the same order (the collectives inside the sharded forward pair up). The
wrapper is never pipelined: a step's input ids must be known before it is broadcast.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llm_server.distributed import GROUP_LOST
from llm_server.distributed.codec import Call, Op, encode
from llm_server.distributed.transport import Transport
from llm_server.engines.contract import (
    EmbeddingInputUnsupported,
    EmbeddingsUnsupported,
    EngineError,
    ScoreChunkResult,
)
from llm_server.engines.kv.budget import HeldBytes
from llm_server.engines.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from llm_server.engines.kv.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")  # how MLX's collectives fail


class GroupLost(EngineError):
    """A rank died or stopped answering: no call can run any more."""


class LockstepEngine:
    """The `Engine` protocol over a sharded engine and a transport to the other ranks."""

    pipelined = False
    # drafts are not verified across ranks: the codec does not carry DecodeRow.draft and a
    # rewind would move rank 0's rows only (scheduler/drafting.py)
    speculative = False
    no_embeddings = "this model does not serve embeddings: it is sharded over ranks"

    def __init__(
        self, engine: Any, transport: Transport, size: int, backend: str, mode: str = "tensor"
    ) -> None:
        self._engine = engine
        self._transport = transport
        self.group_size = size
        self.backend = backend
        self.mode = mode  # "tensor" or "pipeline" (how the model is split over the ranks)
        self.steps = 0  # calls broadcast so far
        # calls each rank completed: rank 0's own count, the followers' as they reported it
        # with the last broadcast (one call behind at most while calls run)
        self.rank_steps = [0] * size
        self.busy_since: float | None = None  # monotonic start of the call in progress
        self.last_sent = time.monotonic()  # when the last call or heartbeat was broadcast
        self.stopped = False  # STOP went out: the followers have left their loop
        self._lock = threading.Lock()
        self.lost: str | None = None  # why the group is gone (then every call fails at once)
        self.on_lost = None  # called once with the reason (launch.py: shut the server down)

    # -- read-only members: the local shard's ------------------------------------------

    @property
    def name(self) -> str:
        return self._engine.name

    @property
    def rows(self) -> int:
        return self._engine.rows

    @property
    def context_length(self) -> int:
        return self._engine.context_length

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def dtype(self) -> str:
        return self._engine.dtype

    @property
    def serial_reason(self) -> str | None:
        return self._engine.serial_reason

    @property
    def shared_prefix_min(self) -> int:
        return self._engine.shared_prefix_min

    @property
    def dynamic_shapes(self) -> bool:
        return self._engine.dynamic_shapes

    @property
    def padded_shapes(self) -> bool:
        return self._engine.padded_shapes

    @property
    def has_lm_head(self) -> bool:
        return self._engine.has_lm_head

    @property
    def score_rows(self) -> int:
        return self._engine.score_rows  # 0 when sharded: the separate session, broadcast

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._engine.prefix_cache

    @property
    def kernels_name(self) -> str | None:
        return self._engine.kernels_name

    @property
    def kv_format_name(self) -> str | None:
        return self._engine.kv_format_name

    def kv_token_bytes(self) -> int | None:
        return self._engine.kv_token_bytes()

    def cursor(self, row: int) -> int:
        return self._engine.cursor(row)

    def cached_tokens(self, row: int) -> int:
        return self._engine.cached_tokens(row)

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int | None:
        return self._engine.preferred_row(tokens, rows)

    def kept_tokens(self) -> int:
        return self._engine.kept_tokens()

    def held_bytes(self) -> HeldBytes:
        return self._engine.held_bytes()  # rank 0's

    def kv_bytes_for(self, positions: int) -> int:
        return self._engine.kv_bytes_for(positions)

    def kv_room(self) -> int | None:
        return self._engine.kv_room()

    def budget_bytes(self) -> int | None:
        return self._engine.budget_bytes()

    def idle_due(self) -> float | None:
        return self._engine.idle_due()  # None when sharded: no rank trims (kv_keep_alive 0)

    def trim_idle(self, force: bool = False) -> bool:
        return self._engine.trim_idle(force)

    def rewind(self, row: int, cursor: int) -> None:
        raise EngineError("a row of a model sharded over ranks cannot be rewound")

    def group_status(self) -> dict[str, Any]:
        """The group as /health reports it."""
        return {
            "backend": self.backend,
            "mode": self.mode,  # tensor or pipeline parallel
            "ranks": self.group_size,
            "steps": self.steps,  # calls every rank ran, in lock-step
            "rank_steps": list(self.rank_steps),  # calls each rank reported done
            "lost": self.lost,
        }

    def _send(self, call: Call) -> None:
        if self.stopped:
            raise RuntimeError("the distributed group is stopped")
        reports = self._transport.send(*encode(call))
        self.last_sent = time.monotonic()
        for rank, n in enumerate(reports[1:], start=1):
            self.rank_steps[rank] = n
        if call.op is not Op.HEARTBEAT:
            self.steps += 1

    def _call(self, call: Call, fn, *args):
        if self.lost is not None:
            raise GroupLost(self.lost)
        with self._lock:
            self.busy_since = time.monotonic()
            try:
                self._send(call)
                try:
                    return fn(*args)
                finally:
                    self.rank_steps[0] = self.steps  # raised or not, the call is done here
            except Exception as exc:
                if any(tag in str(exc) for tag in BACKEND_ERRORS):
                    self.lose(str(exc))
                    raise GroupLost(self.lost) from exc
                raise
            finally:
                self.busy_since = None

    def heartbeat(self, idle: float) -> bool:
        """Broadcast a no-op when no call went out for `idle` seconds (the followers' watchdog
        then knows rank 0 lives, and their reports come in); False when none was due or a call
        holds the group."""
        if self.lost is not None or self.stopped or time.monotonic() - self.last_sent < idle:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # a call is running: it tells the followers as much
        try:
            if self.stopped or self.lost is not None:
                return False
            self.busy_since = time.monotonic()
            self._send(Call(Op.HEARTBEAT))
            return True
        except Exception as exc:  # noqa: BLE001 - any failure of the group's collective
            self.lose(str(exc))
            return False
        finally:
            self.busy_since = None
            self._lock.release()

    def lose(self, reason: str, hung: bool = False) -> None:
        """Mark the group gone: a collective failed, or (`hung`) the watchdog saw one hang,
        and the scheduler thread is stuck in it."""
        if self.lost is not None:
            return
        self.lost = f"{GROUP_LOST}: {reason}"
        log.error("%s", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost, hung)

    def run(self, plan: StepPlan) -> StepResult:
        if any(c.spans for c in plan.prefill):
            self.check_spans(0, [s for c in plan.prefill for s in c.spans])
        return self._call(Call(Op.RUN, plan=plan), self._engine.run, plan)

    def check_spans(self, length: int, spans) -> None:
        """The codec carries token ids only: embedding spans would reach rank 0 alone."""
        if spans:
            raise EmbeddingInputUnsupported(
                "a model sharded over ranks: the model's forward cannot take embeddings"
            )

    def prefill(self, row: int, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, np.int32)
        return self._call(Call(Op.PREFILL, row=row, tokens=ids), self._engine.prefill, row, tokens)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        call = Call(Op.DECODE, rows=tuple(rows), tokens=np.asarray(tokens, np.int32))
        return self._call(call, self._engine.decode, rows, tokens)

    def release(self, row: int) -> None:
        if self.lost is not None:  # nothing to keep in step with: free the row here only
            try:
                self._engine.release(row)
            except Exception:  # noqa: BLE001 - MLX re-raises the ring's error at a sync
                log.debug("releasing row %d after the group was lost", row, exc_info=True)
            return
        self._call(Call(Op.RELEASE, row=row), self._engine.release, row)

    def score_begin(self, batch: int) -> None:
        self._call(Call(Op.SCORE_BEGIN, value=batch), self._engine.score_begin, batch)

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        call = Call(Op.SCORE_CHUNK, tokens=tokens, targets=targets, value=top_k)
        return self._call(call, self._engine.score_chunk, tokens, targets, top_k)

    def score_end(self) -> None:
        self._call(Call(Op.SCORE_END), self._engine.score_end)

    def embed_begin(self, batch: int) -> None:
        raise EmbeddingsUnsupported(self.no_embeddings)

    def embed_chunk(self, tokens: np.ndarray) -> np.ndarray:
        raise EmbeddingsUnsupported(self.no_embeddings)

    def embed_end(self) -> None:
        pass  # no session was opened

    def stop(self) -> None:
        """Tell the followers to leave their loop (once)."""
        if self.lost is not None:
            return
        with self._lock:
            if not self.stopped and self.lost is None:
                self._send(Call(Op.STOP))
                self.stopped = True

    def thread_exit(self) -> None:
        """The scheduler thread ends (the service closes): stop the followers too."""
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - a dead group cannot be told anything
            log.warning("could not stop the other ranks", exc_info=True)
        try:
            self._engine.thread_exit()
        except Exception:  # noqa: BLE001 - after a lost group the streams re-raise its error
            if self.lost is None:
                raise
