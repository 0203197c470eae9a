"""Several pumps (scoring, embeddings) sharing the scheduler's one slot between decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llm_server.engines.contract import Engine


class Pump(Protocol):
    """Work the scheduler runs between steps on a session of its own (embeddings, the session
    scorer fallback)."""

    def pending(self) -> bool: ...

    def run_batch(self, engine: Engine) -> None: ...


class Pumps:
    """Round robin: each call runs ONE forward of the next pump with work, so running
    generations still wait at most one chunk, and neither pump starves the other."""

    def __init__(self, pumps: Sequence[Pump]) -> None:
        if not pumps:
            raise ValueError("Pumps needs at least one pump")
        self.pumps = list(pumps)
        self._next = 0

    def pending(self) -> bool:
        return any(p.pending() for p in self.pumps)

    def run_batch(self, engine: Engine) -> None:
        n = len(self.pumps)
        for i in range(n):
            pump = self.pumps[(self._next + i) % n]
            if pump.pending():
                self._next = (self._next + i + 1) % n
                pump.run_batch(engine)
                return
