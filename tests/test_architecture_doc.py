"""docs/ARCHITECTURE.md defines every rule code (S1..S11, C1..C5) that the code cites."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = re.compile(r"\b([SC](?:1[01]|[1-9]))\b")
DEFINED = re.compile(r"^- \*\*([SC](?:1[01]|[1-9]))\*\* ", re.MULTILINE)


def _cited() -> set[str]:
    cited: set[str] = set()
    for package in ("llm_server", "converters", "replay"):
        for path in (ROOT / package).rglob("*.py"):
            cited.update(CODE.findall(path.read_text()))
    return cited


def test_every_cited_rule_is_defined():
    defined = set(DEFINED.findall((ROOT / "docs" / "ARCHITECTURE.md").read_text()))
    assert {f"S{i}" for i in range(1, 12)} | {f"C{i}" for i in range(1, 6)} <= defined
    missing = _cited() - defined
    assert not missing, f"cited in the code but not defined in docs/ARCHITECTURE.md: {missing}"
