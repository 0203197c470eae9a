"""What the page polls: the models and their memory, the counters the Now view turns into rates,
and the recent requests, read from the server's own state in one call."""

from __future__ import annotations

import time

from llm_server.api.shared.recent import RecentRequests
from llm_server.api.shared.state import AppState
from llm_server.models.manager import ModelManager
from llm_server.models.memory import rss_bytes
from llm_server.models.slots import ModelSlot, Status
from llm_server.service import ModelService

REQUESTS_SHOWN = 100  # rows of the Requests view per poll


def snapshot(state: AppState, recent: RecentRequests | None, shown: int = REQUESTS_SHOWN) -> dict:
    """The page's one poll (counters are totals since start; the page takes differences) with
    the newest `shown` recent requests."""
    now = time.time()
    body: dict = {
        "time": now,
        "draining": state.draining,
        "now": _now(state.services()),
        "requests": recent.latest(shown) if recent is not None else [],
        "requests_source": recent.source if recent is not None else None,
    }
    if recent is not None:
        body["now"].update(recent.percentiles(now))
    if state.manager is not None:
        body["models"] = [_managed(slot) for slot in state.manager.slots.values()]
        body["memory"] = _memory(state.manager)
    else:
        body["models"] = [_single(state)]
        body["memory"] = {"budget": None, "used": None, "rss": rss_bytes()}
    return body


def _now(services: list[ModelService]) -> dict:
    """Sums over the loaded models: rows, running and queued requests, tokens, prefix cache."""
    out = {"rows": 0, "running": 0, "queued": 0, "generated_tokens": 0}
    cache = {"prefix_hits": 0, "prefix_misses": 0, "prefix_hit_tokens": 0}
    has_cache = False
    for svc in services:
        if not svc.ready:
            continue
        stats = svc.scheduler.stats()
        out["rows"] += stats.rows
        out["running"] += stats.rows_busy
        out["queued"] += stats.queued
        out["generated_tokens"] += stats.generated_tokens
        prefix = svc.prefix_cache_stats()
        if prefix is not None:
            has_cache = True
            cache["prefix_hits"] += prefix.hits
            cache["prefix_misses"] += prefix.misses
            cache["prefix_hit_tokens"] += prefix.hit_tokens
    out.update(cache if has_cache else dict.fromkeys(cache))
    return out


def _memory(manager: ModelManager) -> dict:
    return {"budget": manager.config.budget, "used": manager.used(), "rss": rss_bytes()}


def _managed(slot: ModelSlot) -> dict:
    svc = slot.service
    loaded = slot.status is Status.LOADED and svc is not None and svc.ready
    # an unloaded model whose latest load failed shows as failed, with the reason
    status = "failed" if slot.status is Status.UNLOADED and slot.error else slot.status.value
    size = slot.size
    return {
        "id": slot.entry.id,
        "status": status,
        "error": slot.error,
        "source": slot.entry.source,
        "pinned": slot.entry.pinned,
        "bytes": slot.counted,
        "memory": (
            {"weights": size.weights, "kv": size.kv, "prefix_cache": size.prefix_cache}
            if size is not None
            else None
        ),
        "context_length": svc.context_length if loaded else slot.entry.context_length,
        "last_used": slot.last_used,
        "active_requests": slot.active,
        "manageable": True,
    }


def _single(state: AppState) -> dict:
    svc = state.service
    ready = svc is not None and svc.ready
    return {
        "id": state.model_id,
        "status": "loaded" if ready else "loading",
        "error": None,
        "source": None,
        "pinned": True,
        "bytes": None,
        "memory": None,
        "context_length": svc.context_length if ready else None,
        "last_used": None,
        "active_requests": svc.scheduler.stats().rows_busy if ready else 0,
        "manageable": False,  # one model (--model): nothing to load or unload
    }
