"""Resident memory through a sequence of loads and unloads under a budget that holds two copies
of a model: `python -m llm_server.benchmark.model_memory [MODEL]` (default: the embedded model)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from llm_server.models.manager import ManagerConfig, ModelManager
from llm_server.models.memory import estimate_size, format_bytes, rss_bytes
from llm_server.models.registry import ModelEntry


def _mlx_active() -> int:
    import mlx.core as mx

    return mx.get_active_memory()


async def measure(source: Path) -> list[tuple[str, int, int, int]]:
    """(step, RSS, MLX arrays, budgeted bytes) after each step: load A, load B, unload A,
    load C."""
    from llm_server.server import make_service
    from llm_server.settings import ServerSettings

    size = estimate_size(source, 1, None)
    budget = 2 * size.total + size.total // 2  # holds two, not three
    entries = [ModelEntry(id=name, source=str(source)) for name in ("A", "B", "C")]
    manager = ModelManager(
        entries,
        ManagerConfig(budget=budget),
        lambda e, p: make_service(ServerSettings().replace(model_id=e.id), p),
        lambda e, p: estimate_size(p, 1, None),
        Path,
    )
    rows = [("start", rss_bytes(), _mlx_active(), manager.used())]
    for verb, name in (("load", "A"), ("load", "B"), ("unload", "A"), ("load", "C")):
        await (manager.load(name) if verb == "load" else manager.unload(name))
        rows.append((f"{verb} {name}", rss_bytes(), _mlx_active(), manager.used()))
    await manager.close()
    print(
        f"model {source}: {format_bytes(size.total)} budgeted each; budget {format_bytes(budget)}"
    )
    return rows


def main() -> None:
    if len(sys.argv) > 1:
        source = Path(sys.argv[1])
    else:
        from llm_server.default_model import default_model_path

        source = default_model_path()
    for step, rss, arrays, used in asyncio.run(measure(source)):
        print(
            f"{step:10} RSS {format_bytes(rss):>8}  MLX arrays {format_bytes(arrays):>8}  "
            f"budgeted {format_bytes(used):>8}"
        )


if __name__ == "__main__":
    main()
