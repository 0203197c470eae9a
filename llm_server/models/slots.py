"""A registered model's state in the daemon, and the errors a request for it can meet."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from pathlib import Path

from llm_server.engines.kv.budget import MemoryBudget
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
    budget: MemoryBudget | None = field(default=None, repr=False)  # the manager's

    @property
    def counted(self) -> int:
        """Bytes this slot holds against the budget now (measured; at least its floor)."""
        if self.status is Status.UNLOADED or self.size is None or self.budget is None:
            return 0
        return self.budget.counted(self.entry.id)

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
            "size_bytes": self.counted if size else None,  # what the budget counts now
            "last_used": int(self.last_used) if self.last_used else None,
            "active_requests": self.active,
            "error": self.error,
        }
        if size is not None:
            out["context_length"] = self._context()
            out["memory"] = {  # the most it could hold (nothing reserves it)
                "weights": size.weights,
                "kv": size.kv,
                "prefix_cache": size.prefix_cache,
                "needed": size.needed,
            }
            out["held"] = self.held()
        return out

    def held(self) -> dict[str, int] | None:
        """Bytes the loaded model holds now by kind (None: no engine yet)."""
        service = self.service
        if service is None or not service.ready:
            return None
        return service.engine.held_bytes().as_dict()

    def _context(self) -> int | None:
        """Positions per row: the loaded engine's, else the estimate's default."""
        service = self.service
        if service is not None and service.ready:
            return service.engine.context_length
        return self.size.context or None if self.size is not None else None


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
            f"model {model!r} needs {format_bytes(size.needed)} ({size.needed} bytes: weights "
            f"{format_bytes(size.weights)}, its first row's KV {format_bytes(size.floor)}) but "
            f"the memory budget is {format_bytes(budget)} ({budget} bytes); raise "
            "--max-memory or lower its context_length"
        )


class InsufficientMemory(ModelError):
    status, code, retry_after = 503, "insufficient_memory", 5


class ModelInUse(ModelError):
    status, code = 409, "model_busy"


class ModelBusy(ModelError):
    status, code, retry_after = 429, "queue_full", 1
