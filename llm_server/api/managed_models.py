"""Models routes of a many-model daemon: list with status, load, unload, per-model health."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_server.api.shared.errors import APIError
from llm_server.api.shared.images import input_modalities
from llm_server.api.shared.state import AppState
from llm_server.models.manager import ModelManager
from llm_server.models.memory import rss_bytes
from llm_server.models.slots import ModelError, ModelSlot, Status


def _manager(request: Request) -> ModelManager:
    manager = request.app.state.llm.manager
    if manager is None:
        raise APIError(
            404,
            "this server serves one model (--model); loading and unloading need --models FILE",
            code="not_found",
        )
    return manager


def list_managed(manager: ModelManager) -> Response:
    data = [_described(slot) for slot in manager.slots.values()]
    return JSONResponse({"object": "list", "data": data, "memory": memory(manager)})


def memory(manager: ModelManager) -> dict:
    """The budget, what it counts now (`used`: each loaded model at least its floor), and
    the bytes held by kind over every loaded model (as allocated)."""
    held = manager.budget.held()
    kinds = {
        kind: sum(h.as_dict()[kind] for h in held.values())
        for kind in ("weights", "kv", "prefix_cache", "total")
    }
    return {
        "budget": manager.config.budget,
        "used": manager.used(),
        "held": kinds,
        "rss": rss_bytes(),
    }


async def model_action(request: Request) -> Response:
    """GET /v1/models/{id}, POST /v1/models/{id}/load and /v1/models/{id}/unload (ids may hold
    a slash, as hub ids do)."""
    manager = _manager(request)
    rest: str = request.path_params["rest"]
    name, _, action = rest.rpartition("/")
    try:
        if request.method == "GET":
            return JSONResponse(_described(manager.slot(rest)))
        if action == "load" and name:
            slot = await manager.load(name)
        elif action == "unload" and name:
            slot = await manager.unload(name)
        else:
            raise APIError(404, f"no route {request.url.path}", code="not_found")
    except ModelError as exc:
        raise APIError(exc.status, str(exc), param="model", code=exc.code) from None
    return JSONResponse(_described(slot))


def _described(slot: ModelSlot) -> dict:
    """The slot as models/slots.py describes it, and what it reads (null until loaded)."""
    return {**slot.describe(), "input_modalities": input_modalities(slot.service)}


def managed_health(state: AppState, manager: ModelManager) -> Response:
    """Ready while not draining; each model's status, and its scheduler's when loaded."""
    models = {}
    for model_id, slot in manager.slots.items():
        entry: dict = {"status": slot.status.value, "error": slot.error}
        svc = slot.service
        if slot.status is Status.LOADED and svc is not None and svc.ready:
            stats = svc.scheduler.stats()
            entry.update(
                {
                    "engine": svc.engine.name,
                    "concurrent_requests": stats.rows,
                    "rows_busy": stats.rows_busy,
                    "queue_length": stats.queued,
                    "context_length": svc.context_length,
                    "last_error": stats.last_error,
                    "held": svc.engine.held_bytes().as_dict(),
                }
            )
            cache = svc.prefix_cache_stats()
            if cache is not None:
                entry["prefix_cache"] = dataclasses.asdict(cache)  # as single-model /health
        models[model_id] = entry
    ready = not state.draining
    body = {
        "status": "draining" if state.draining else "ok",
        "ready": ready,
        "model": manager.default_id,
        "models": models,
        "memory": memory(manager),
    }
    return JSONResponse(body, status_code=200 if ready else 503)
