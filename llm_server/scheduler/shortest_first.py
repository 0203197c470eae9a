"""The queue behind scoring and embedding pumps: inputs of many requests, taken shortest first
into batches that stop before a third of their positions would be padding (C2)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from llm_server.scheduler.request import QueueFull, SchedulerClosed


class PumpRequest:
    """What a scoring or embedding request shares (a mixin for its dataclass): `future` gets
    its result, `started` is set once one of its inputs enters a batch."""

    future: Future
    started: bool

    @property
    def abandoned(self) -> bool:
        return self.future.done()  # cancelled by the caller, or already failed

    def claim(self) -> bool:
        """Mark the request running (scheduler thread); False if the caller cancelled it."""
        if self.started:
            return not self.abandoned
        self.started = True
        return self.future.set_running_or_notify_cancel()

    def fail(self, exc: BaseException) -> None:
        """Fail the request unless the caller already cancelled it."""
        if self.claim():
            self.future.set_exception(exc)


class QueuedInput(Protocol):
    """One input of a request: its tokens, and the request it belongs to."""

    @property
    def tokens(self) -> list[int]: ...

    request: PumpRequest


def batch_size(lengths: Sequence[int], max_rows: int) -> int:
    """How many of `lengths` (sorted ascending) form one batch (C2).

    Takes prompts in order and stops before a third of the batch's positions
    (rows x longest) would be padding; the first prompt is always taken.
    """
    n, total = 0, 0
    for length in lengths[:max_rows]:
        positions = (n + 1) * length
        if n and 3 * (positions - total - length) >= positions:
            break
        n, total = n + 1, total + length
    return n


class ShortestFirstQueue:
    """Thread-safe: any thread pushes a request's inputs; the scheduler thread takes batches."""

    def __init__(
        self, wake: Callable[[], None], max_queued: int, retry_after: float, what: str
    ) -> None:
        self._wake = wake
        self.max_queued = max_queued  # requests with inputs queued or running
        self.retry_after = retry_after
        self._what = what  # "scoring" | "embedding", for the shutdown message
        self._lock = threading.RLock()
        self._heap: list[tuple[int, int, QueuedInput]] = []  # (length, arrival, input)
        self._arrivals = itertools.count()
        self._requests = 0
        self._closed = False

    def push(self, request: PumpRequest, items: Sequence[QueuedInput]) -> None:
        """Queue every input of `request` together; raises QueueFull/SchedulerClosed."""
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if self._requests >= self.max_queued:
                raise QueueFull(0, self._requests, self.retry_after)
            for item in items:
                heapq.heappush(self._heap, (len(item.tokens), next(self._arrivals), item))
            self._requests += 1
        request.future.add_done_callback(self._request_done)
        self._wake()

    def _request_done(self, _: object) -> None:
        with self._lock:
            self._requests -= 1

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._heap)

    def take(self, cap: int, padded: bool = True) -> list[QueuedInput]:
        """The next batch (at most `cap` inputs, C2), abandoned requests' inputs dropped.
        `padded` False: the inputs do not share a padded shape (scoring rows), so the `cap`
        shortest are taken whatever their lengths."""
        with self._lock:
            live = [e for e in self._heap if not e[2].request.abandoned]
            if len(live) != len(self._heap):
                self._heap = live
                heapq.heapify(self._heap)
            lengths = [e[0] for e in heapq.nsmallest(cap, self._heap)]
            n = batch_size(lengths, cap) if padded else len(lengths)
            return [heapq.heappop(self._heap)[2] for _ in range(n)]

    def close(self) -> list[QueuedInput]:
        """Refuse new requests; returns the queued inputs for the caller to fail."""
        with self._lock:
            self._closed = True
            queued = [item for _, _, item in self._heap]
            self._heap.clear()
        return queued

    def closed_error(self) -> SchedulerClosed:
        return SchedulerClosed(f"the server shut down before {self._what}")
