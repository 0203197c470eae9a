"""The many-model daemon's parts (`--models FILE`): the manager from the CLI's settings and the
app's per-model metrics (server.run_models_server wires them to uvicorn)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from llm_server.engines.kv.budget import Account
from llm_server.model_source import resolve_model_source
from llm_server.models.manager import ManagerConfig, ModelManager
from llm_server.models.memory import ModelSize, default_budget, estimate_size
from llm_server.models.metrics import ModelsCollector
from llm_server.models.registry import ModelEntry
from llm_server.service import ModelService
from llm_server.settings import DEFAULT_LOAD_WAIT_S, ServerSettings

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def entry_settings(settings: ServerSettings, entry: ModelEntry) -> ServerSettings:
    """The CLI's settings with the entry's id, aliases and own overrides (one process: no
    group); the prefix cache's disk tier in the entry's own subfolder of --prefix-cache-dir."""
    overrides = {
        "rows": entry.concurrent_requests,
        "context_length": entry.context_length,
        "keep_quantized": entry.keep_quantized,
        "pooling": entry.pooling,
        "tool_parser": entry.tool_parser,
    }
    given = {name: value for name, value in overrides.items() if value is not None}
    root = settings.engine.prefix_cache_dir
    if root is not None:
        given["prefix_cache_dir"] = Path(root) / model_folder(entry.id)
    return settings.replace(**given, model_id=entry.id, aliases=entry.aliases, group=None)


def load_settings(
    settings: ServerSettings, entry: ModelEntry, size: ModelSize, account: Account
) -> ServerSettings:
    """The entry's settings for its load: its budget account, and (no `context_length` of
    its own) the context its rows hold within the budget (the estimate's)."""
    own = entry_settings(settings, entry)
    context = own.engine.context_length or size.context or None
    return own.replace(budget=account, context_length=context)


def model_folder(model_id: str) -> str:
    """The subfolder of --prefix-cache-dir that holds `model_id`'s disk tier: the id itself
    when it is a plain file name, else (a hub id's slash, ...) the id made safe plus a digest,
    so two ids never share a folder."""
    if _SAFE_NAME.fullmatch(model_id) and not model_id.startswith("kv_"):
        return model_id
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', model_id).strip('.')}-{digest}"


def share_disk(settings: ServerSettings, models: int) -> ServerSettings:
    """The settings with --prefix-cache-disk-bytes split evenly over `models` (each model's
    disk tier bounds its own subfolder, so together they stay within the one bound)."""
    root = settings.engine.prefix_cache_dir
    if root is None:
        return settings
    from llm_server.engines.kv.prefix_disk import default_disk_bytes

    total = settings.engine.prefix_cache_disk_bytes
    if total is None:
        total = default_disk_bytes(Path(root))
    return settings.replace(prefix_cache_disk_bytes=total // max(models, 1))


def build_manager(
    settings: ServerSettings,
    entries: list[ModelEntry],
    make_service: Callable[[ServerSettings, Path], ModelService],
    max_memory: int | None = None,
    idle_unload: float | None = None,
    load_wait: float | None = None,
) -> ModelManager:
    """The manager for the CLI's settings; `make_service(settings, path)` starts one model's
    service (server.make_service); `max_memory`: the budget (None: default_budget);
    `load_wait`: seconds a load waits for a model to go idle (None: ManagerConfig's)."""
    settings = share_disk(settings, len(entries))

    budget = max_memory if max_memory is not None else default_budget()

    def factory(entry: ModelEntry, path: Path, size: ModelSize, account: Account) -> ModelService:
        return make_service(load_settings(settings, entry, size, account), path)

    def estimate(entry: ModelEntry, path: Path) -> ModelSize:
        engine = entry_settings(settings, entry).engine
        return estimate_size(
            path,
            engine.rows,
            engine.context_length,
            engine.dtype,
            engine.keep_quantized,
            engine.prefix_cache_bytes,
            engine.score_rows,
            budget=budget,
            kv_format=(engine.kv_dtype, engine.kv_bits, engine.kv_group_size),
        )

    config = ManagerConfig(
        budget=budget,
        idle_unload=idle_unload,
        max_waiting=settings.service.max_queued,
        load_wait=DEFAULT_LOAD_WAIT_S if load_wait is None else load_wait,
    )
    return ModelManager(entries, config, factory, estimate, resolve_source)


def resolve_source(source: str) -> Path:
    """A registry source as a folder to load; "default" is the embedded default model."""
    return resolve_model_source(None if source == "default" else source).path


class _Managed(Protocol):
    """The app state of a many-model daemon (api.state.AppState; models/ does not import api/)."""

    manager: ModelManager


def manage(state: _Managed, app) -> None:
    """Per-model metrics on the app: step listeners on each loaded service, labelled gauges."""
    manager = state.manager
    manager.on_loaded(lambda _id, service: app.state.metrics.attach(service))
    app.state.metrics.registry.register(ModelsCollector(manager))
