"""What the daemon admits at budgets of 16, 32 and 64 GB on a Mac (Metal: the checkpoint's
bfloat16, 4-bit layers kept quantized), with the defaults (4 concurrent requests, 8 scoring
rows, the prefix cache's default bound), and each model's default context (what its rows hold
in the budget beside its weights): `python -m llm_server.benchmark.admission [DIR]` builds the
header-only checkpoints (testing/header_checkpoints.py; sparse files, ~2 MB on disk) in DIR
(default: a temporary folder) and prints the table docs/models.md shows."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llm_server.models.memory import ModelSize, estimate_size, row_bytes
from llm_server.testing.header_checkpoints import CONFIGS, build

GiB = 1 << 30
BUDGETS = (16 * GiB, 32 * GiB, 64 * GiB)
ROWS = 4  # --concurrent-requests' default


@dataclass(frozen=True)
class Admission:
    """One model at one budget."""

    model: str
    budget: int
    size: ModelSize  # at the budget's default context
    max_context: int  # the model's own

    @property
    def admitted(self) -> bool:
        return self.size.needed <= self.budget


def admissions(root: Path) -> list[Admission]:
    import json

    out = []
    for name in CONFIGS:
        path = build(root, name)
        config = json.loads((path / "config.json").read_text())
        max_context = int(config.get("text_config", config)["max_position_embeddings"])
        for budget in BUDGETS:
            size = estimate_size(path, ROWS, None, None, False, None, budget=budget, on_cpu=False)
            out.append(Admission(name, budget, size, max_context))
    return out


def table(rows: list[Admission], root: Path) -> str:
    head = "| model | weights | KV a position (one row) | declared context |"
    head += "".join(f" --max-memory {b // GiB}G |" for b in BUDGETS)
    lines = [head, "|---|---|---|---|" + "---|" * len(BUDGETS)]
    for name in CONFIGS:
        mine = [r for r in rows if r.model == name]
        held = row_bytes(_config(root, name), 2)
        per = f"{held.position / 1024:.0f} KiB" if held is not None else "?"
        if held is not None and held.state:
            per += f" + {held.state / (1 << 20):.0f} MiB state"
        cells = "".join(
            f" {r.size.context:,} positions a row |" if r.admitted else " not admitted |"
            for r in mine
        )
        lines.append(
            f"| {name} | {mine[0].size.weights / GiB:.1f} GiB | {per} | "
            f"{mine[0].max_context:,} |{cells}"
        )
    return "\n".join(lines)


def _config(root: Path, name: str) -> dict:
    import json

    return json.loads((build(root, name) / "config.json").read_text())


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    print(table(admissions(root), root))


if __name__ == "__main__":
    main()
