"""Every relative link in README.md and docs/*.md names a file that exists and, with an anchor, a
heading of that file (GitHub's slugs: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$")


def _slugs(text: str) -> set[str]:
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _broken(doc: Path) -> list[str]:
    broken = []
    for link in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", link):
            continue  # a URL
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _slugs(target.read_text()):
            broken.append(f"{link}: no such heading")
    return broken


def test_slugs_follow_githubs_rules():
    text = "# A (`b/c.py`)\n## Tool calls, in detail\n```\n# not a heading\n```\n## Tool calls, in detail"
    assert _slugs(text) == {"a-bcpy", "tool-calls-in-detail", "tool-calls-in-detail-1"}


def test_every_link_between_the_docs_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = {doc.name: b for doc in docs if (b := _broken(doc))}
    assert not broken, broken


# a path cited in backticks, `engines/mlx/engine.py` or `llm_server/api/app.py:create_app`
CITED = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|md|c|cpp|toml|sh|json))(?::[^`]*)?`")


def _cited_paths_missing(doc: Path) -> list[str]:
    """The repository paths `doc` cites in backticks that do not exist: a path is read from the
    repository root, from `llm_server/` (the docs write `engines/...` for the package's
    folders) or from the doc's own folder; paths inside a model folder (`1_Pooling/...`) are
    not the repository's and are left alone."""
    roots = {p.name for p in ROOT.iterdir()} | {p.name for p in (ROOT / "llm_server").iterdir()}
    missing = []
    for path in CITED.findall(doc.read_text()):
        if path.split("/")[0] not in roots:
            continue
        if not any((base / path).exists() for base in (ROOT, ROOT / "llm_server", doc.parent)):
            missing.append(path)
    return missing


def test_every_path_the_docs_cite_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {doc.name: m for doc in docs if (m := _cited_paths_missing(doc))}
    assert not missing, missing
