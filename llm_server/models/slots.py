"""A registered model's state in the daemon, and the errors a request for it can meet."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from pathlib import Path

from llm_server.models.memory import ModelSize, format_bytes
from llm_server.models.registry import ModelEntry
from llm_server.service import ModelService


class Status(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass
class ModelSlot:
    """One registered model: its service while loaded, and what the budget and TTLs read."""

    entry: ModelEntry
    status: Status = Status.UNLOADED
    service: ModelService | None = None
    path: Path | None = None  # the resolved source, once a load resolved it
    size: ModelSize | None = None  # counted against the budget from its load's start
    active: int = 0  # requests holding the service now (never unloaded under them)
    waiting: int = 0  # requests waiting for the load
    last_used: float | None = None  # wall time (seconds) a request last let go of it
    used_seq: int = 0  # LRU order: the manager's counter at the latest use
    expires: float | None = None  # monotonic deadline of the idle unload; None: never
    error: str | None = None  # why the latest load failed
    task: asyncio.Task | None = field(default=None, repr=False)  # the load or unload running
    loaded_at: float | None = None

    @property
    def counted(self) -> int:
        """Bytes this slot holds against the budget now."""
        if self.status is Status.UNLOADED or self.size is None:
            return 0
        return self.size.total

    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def describe(self) -> dict:
        """The slot as /v1/models and `llm-server ps` show it."""
        size = self.size
        out: dict = {
            "id": self.entry.id,
            "object": "model",
            "created": int(self.loaded_at or time.time()),
            "owned_by": "llm-server",
            "status": self.status.value,
            "source": self.entry.source,
            "aliases": list(self.entry.aliases),
            "pinned": self.entry.pinned,
            "cached": self.entry.cached,
            "size_bytes": size.total if size else None,
            "last_used": int(self.last_used) if self.last_used else None,
            "active_requests": self.active,
            "error": self.error,
        }
        if size is not None:
            out["memory"] = {
                "weights": size.weights,
                "kv": size.kv,
                "prefix_cache": size.prefix_cache,
            }
        return out


class ModelError(Exception):
    """A request's model cannot serve it now; `status` and `code` are the HTTP answer."""

    status = 500
    code = "model_error"
    retry_after: int | None = None


class ModelNotFound(ModelError):
    status, code = 404, "model_not_found"


class ModelLoadFailed(ModelError):
    status, code = 500, "model_load_failed"


class ModelTooLarge(ModelError):
    status, code = 500, "model_too_large"

    def __init__(self, model: str, size: ModelSize, budget: int) -> None:
        super().__init__(
            f"model {model!r} needs {format_bytes(size.total)} ({size.total} bytes: weights "
            f"{format_bytes(size.weights)}, KV rows {format_bytes(size.kv)}, prefix cache "
            f"{format_bytes(size.prefix_cache)}) but the memory budget is "
            f"{format_bytes(budget)} ({budget} bytes); raise --max-memory or lower its "
            "context_length / concurrent_requests"
        )


class InsufficientMemory(ModelError):
    status, code, retry_after = 503, "insufficient_memory", 5


class ModelInUse(ModelError):
    status, code = 409, "model_busy"


class ModelBusy(ModelError):
    status, code, retry_after = 429, "queue_full", 1
