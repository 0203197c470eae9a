"""Moving rank 0's (header, payload) to every rank: an `all_sum` where only rank 0 writes.

`GroupTransport` rides MLX's own collectives (ring over TCP or Thunderbolt, JACCL, MPI), so the
plan goes the same way as the model's activations. The same collective carries each follower's
count of completed calls back to rank 0 (its own slot of the frame's tail), so rank 0 knows
every rank's progress at no extra round trip. `QueueTransport` is an in-process stand-in for
tests of the follower loop.
"""

from __future__ import annotations

import queue
from typing import Protocol

import numpy as np

from llm_server.distributed.codec import HEADER, payload_size

REPORTS = 16  # ranks whose completed-call counts ride each frame (more ranks go unreported)


class Transport(Protocol):
    def send(self, header: np.ndarray, payload: np.ndarray) -> list[int]:
        """Broadcast a call; returns the calls each rank reported completed (rank 0's: 0)."""
        ...

    def receive(self, completed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The next call, reporting `completed` calls run here so far."""
        ...


class GroupTransport:
    """Broadcast through an `mx.distributed` group: rank 0 sends, the others receive.

    One `all_sum` of a fixed `FRAME`-int buffer carries the header, a payload of up to
    `INLINE` ints (a decode step of a hundred rows) and the followers' reports (the last
    `REPORTS` ints, one per rank); a longer payload (a prompt) follows in a second `all_sum` of
    the length the header announces. Each collective costs a round trip of the ring, so the
    common step takes one.
    """

    FRAME = 256
    INLINE = FRAME - HEADER - REPORTS

    def __init__(self, group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def _sum(self, values: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        out = mx.distributed.all_sum(mx.array(values), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return np.array(out)

    def send(self, header: np.ndarray, payload: np.ndarray) -> list[int]:
        frame = np.zeros(self.FRAME, np.int32)
        frame[:HEADER] = header
        inline = payload.size <= self.INLINE
        if inline:
            frame[HEADER : HEADER + payload.size] = payload
        reports = self._sum(frame)[self.FRAME - REPORTS :]
        if not inline:
            self._sum(payload)
        return [int(n) for n in reports[: min(self.size, REPORTS)]]

    def receive(self, completed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        frame = np.zeros(self.FRAME, np.int32)
        if self.rank < REPORTS:
            frame[self.FRAME - REPORTS + self.rank] = completed
        frame = self._sum(frame)
        header = frame[:HEADER]
        n = payload_size(header)
        if n <= self.INLINE:
            return header, frame[HEADER : HEADER + n].copy()
        return header, self._sum(np.zeros(n, np.int32))


class QueueTransport:
    """One sender, one receiver, in one process (tests): the receiver's report is the one it
    gave with its last receive."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[np.ndarray, np.ndarray]] = queue.Queue()
        self.completed = 0

    def send(self, header: np.ndarray, payload: np.ndarray) -> list[int]:
        self._queue.put((header.copy(), payload.copy()))
        return [0, self.completed]

    def receive(self, completed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        self.completed = completed
        return self._queue.get(timeout=30)
