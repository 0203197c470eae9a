"""Held bytes against resident memory: two copies of a model under a budget of 1500M, then a
third that evicts the least recently used, each answering a prompt over real HTTP:
`python -m llm_server.benchmark.model_memory [MODEL] [BUDGET]` (default: the embedded model,
1500M). Prints, after each step, the process's RSS growth since the start and the bytes the
budget counts as held (what /health reports), and their ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from llm_server.models.memory import format_bytes, rss_bytes
from llm_server.models.registry import ModelEntry

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 40  # ~480 tokens


def _ask(url: str, model: str) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code


def measure(source: Path, budget: int) -> list[tuple[str, int, int, int, str]]:
    """(step, RSS growth, held bytes, bytes counted, models loaded) after each step: ask A,
    ask B, ask C (evicts A), ask A again (evicts B)."""
    from llm_server.testing.managed import ManagedServer

    entries = [ModelEntry(id=name, source=str(source)) for name in ("A", "B", "C")]
    start = rss_bytes()
    rows = []
    with ManagedServer(entries, budget=budget) as srv:
        for name in ("A", "B", "C", "A"):
            code = _ask(srv.url, name)
            memory = httpx.get(f"{srv.url}/health", timeout=30).json()["memory"]
            loaded = ",".join(m for m, s in srv.manager.slots.items() if s.service is not None)
            import mlx.core as mx

            step = (
                f"ask {name}: {code} (MLX active {format_bytes(mx.get_active_memory())}, "
                f"cache {format_bytes(mx.get_cache_memory())})"
            )
            rows.append(
                (step, rss_bytes() - start, memory["held"]["total"], memory["used"], loaded)
            )
    return rows


def main() -> None:
    from llm_server.cli import _size

    if len(sys.argv) > 1:
        source = Path(sys.argv[1])
    else:
        from llm_server.default_model import default_model_path

        source = default_model_path()
    budget = _size(sys.argv[2]) if len(sys.argv) > 2 else _size("1500M")
    print(f"model {source}, budget {format_bytes(budget)}")
    print("| step | loaded | RSS growth (MB) | held (MB) | held / RSS growth | counted (MB) |")
    print("|---|---|---|---|---|---|")
    mb = 1 << 20
    for step, grown, held, used, loaded in measure(source, budget):
        print(
            f"| {step} | {loaded} | {grown / mb:.1f} | {held / mb:.1f} | {held / grown:.3f} | "
            f"{used / mb:.1f} |"
        )


if __name__ == "__main__":
    main()
