"""Continuous-batching scheduler: requests share the engine's rows (docs/ARCHITECTURE.md S1-S10)."""

from llm_server.scheduler.batch import BatchScheduler, SchedulerStats
from llm_server.scheduler.request import (
    FinishEvent,
    GenerationRequest,
    Priority,
    QueueFull,
    SchedulerClosed,
    TokenEvent,
)

__all__ = [
    "BatchScheduler",
    "FinishEvent",
    "GenerationRequest",
    "Priority",
    "QueueFull",
    "SchedulerClosed",
    "SchedulerStats",
    "TokenEvent",
]
