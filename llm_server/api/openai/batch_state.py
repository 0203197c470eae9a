"""The Batch API's part of the app: its store and runner, when batch lines may take a row, and
OpenAI's list pages (`after`, `limit`, `has_more`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from llm_server.api.shared.errors import invalid
from llm_server.api.shared.state import AppState
from llm_server.batch.asgi import app_caller
from llm_server.batch.runner import BatchRunner
from llm_server.batch.store import BatchStore, default_data_dir
from llm_server.models.slots import ModelError


@dataclass
class BatchAPI:
    """What the files and batches routes share (app.state.batch)."""

    store: BatchStore
    runner: BatchRunner
    max_file_bytes: int


def attach_batch_api(
    app, state: AppState, data_dir: Path | None, max_file_bytes: int, api_key: str | None
) -> BatchAPI:
    """The Batch API over `app`: files and batches under `data_dir` (None: the user's data
    folder), lines sent through `app` itself with `api_key`."""
    store = BatchStore(Path(data_dir) if data_dir is not None else default_data_dir())
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    runner = BatchRunner(store, app_caller(app, headers), lambda model: batch_room(state, model))
    return BatchAPI(store, runner, max_file_bytes)


def batch_room(state: AppState, model: str | None) -> int:
    """How many lines for `model` may be in the app now (S11): none while an interactive
    request waits for a row or the model is loading; else every row (an interactive request
    arriving takes a line's row at the next step boundary: BatchScheduler._preempt)."""
    if state.draining:
        return 0
    service = state.service
    if state.manager is not None:
        try:
            service = state.manager.slot(model).service
        except ModelError:
            return 1  # unknown model: the line runs to get its 404
        if service is None:
            return 1  # not loaded: the line's request loads it under the memory budget
    if service is None or not service.ready:
        return 0
    scheduler = service.scheduler
    if scheduler.interactive_waiting():
        return 0
    return scheduler.max_concurrent


def batch_api(request: Request) -> BatchAPI:
    api: BatchAPI = request.app.state.batch
    api.runner.ensure_started()  # on this loop (a server without lifespan events: tests)
    return api


def page(items: list[dict], query: Mapping[str, str], default_limit: int, max_limit: int) -> dict:
    """OpenAI's list object over `items` (already in order): those after the id `after`, at
    most `limit`, and whether more follow."""
    raw = query.get("limit")
    try:
        limit = default_limit if raw is None else int(raw)
    except ValueError:
        raise invalid("limit", "'limit' must be an integer") from None
    if not 1 <= limit <= max_limit:
        raise invalid("limit", f"'limit' must be between 1 and {max_limit}")
    after = query.get("after")
    if after:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
