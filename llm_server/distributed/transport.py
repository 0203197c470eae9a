"""Moving rank 0's (header, payload) to every rank: an `all_sum` where only rank 0 writes.

`GroupTransport` rides MLX's own collectives (ring over TCP or Thunderbolt, JACCL, MPI), so the
plan goes the same way as the model's activations. `QueueTransport` is an in-process stand-in
for tests of the follower loop.
"""

from __future__ import annotations

import queue
from typing import Protocol

import numpy as np

from llm_server.distributed.codec import HEADER, payload_size


class Transport(Protocol):
    def send(self, header: np.ndarray, payload: np.ndarray) -> None: ...

    def receive(self) -> tuple[np.ndarray, np.ndarray]: ...


class GroupTransport:
    """Broadcast through an `mx.distributed` group: rank 0 sends, the others receive.

    One `all_sum` of a fixed `FRAME`-int buffer carries the header and a payload of up to
    `FRAME - HEADER` ints (a decode step of a hundred rows); a longer payload (a prompt) follows
    in a second `all_sum` of the length the header announces. Each collective costs a round
    trip of the ring, so the common step takes one.
    """

    FRAME = 256

    def __init__(self, group) -> None:
        self.group = group

    def _sum(self, values: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        out = mx.distributed.all_sum(mx.array(values), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return np.array(out)

    def send(self, header: np.ndarray, payload: np.ndarray) -> None:
        frame = np.zeros(self.FRAME, np.int32)
        frame[:HEADER] = header
        inline = payload.size <= self.FRAME - HEADER
        if inline:
            frame[HEADER : HEADER + payload.size] = payload
        self._sum(frame)
        if not inline:
            self._sum(payload)

    def receive(self) -> tuple[np.ndarray, np.ndarray]:
        frame = self._sum(np.zeros(self.FRAME, np.int32))
        header = frame[:HEADER]
        n = payload_size(header)
        if n <= self.FRAME - HEADER:
            return header, frame[HEADER : HEADER + n].copy()
        return header, self._sum(np.zeros(n, np.int32))


class QueueTransport:
    """One sender, one receiver, in one process (tests)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[np.ndarray, np.ndarray]] = queue.Queue()

    def send(self, header: np.ndarray, payload: np.ndarray) -> None:
        self._queue.put((header.copy(), payload.copy()))

    def receive(self) -> tuple[np.ndarray, np.ndarray]:
        return self._queue.get(timeout=30)
