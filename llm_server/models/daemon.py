"""The many-model daemon's parts (`--models FILE`): the manager from the CLI's settings and the
app's per-model metrics (server.run_models_server wires them to uvicorn)."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from llm_server.model_source import resolve_model_source
from llm_server.models.manager import ManagerConfig, ModelManager
from llm_server.models.memory import ModelSize, default_budget, estimate_size
from llm_server.models.metrics import ModelsCollector
from llm_server.models.registry import ModelEntry
from llm_server.service import ModelService


def entry_args(args: argparse.Namespace, entry: ModelEntry) -> argparse.Namespace:
    """The CLI's settings with the entry's own overrides."""
    out = copy.copy(args)
    for name in (
        "concurrent_requests",
        "context_length",
        "keep_quantized",
        "pooling",
        "tool_parser",
    ):
        value = getattr(entry, name)
        if value is not None:
            setattr(out, name, value)
    out.group = None
    return out


def build_manager(
    args: argparse.Namespace, entries: list[ModelEntry], service_from_args: Callable
) -> ModelManager:
    """The manager for the CLI's settings; `service_from_args(args, path, id, aliases=...)`
    starts one model's service (server.service_from_args)."""

    def factory(entry: ModelEntry, path: Path) -> ModelService:
        return service_from_args(entry_args(args, entry), path, entry.id, aliases=entry.aliases)

    def estimate(entry: ModelEntry, path: Path) -> ModelSize:
        a = entry_args(args, entry)
        return estimate_size(
            path,
            a.concurrent_requests,
            a.context_length,
            a.dtype,
            a.keep_quantized,
            a.prefix_cache_bytes,
        )

    budget = args.max_memory if args.max_memory is not None else default_budget()
    config = ManagerConfig(budget=budget, idle_unload=args.idle_unload, max_waiting=args.max_queued)
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
