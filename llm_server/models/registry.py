"""The registry of servable models: `--models FILE` (TOML `[[models]]` tables) and the HF cache."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from llm_server.tools.registry import PARSERS

_FIELDS = {
    "id": str,
    "source": str,
    "aliases": list,
    "pinned": bool,
    "idle_ttl": (int, float),
    "concurrent_requests": int,
    "context_length": int,
    "keep_quantized": bool,
    "pooling": str,
    "tool_parser": str,
}
_POOLING = ("last", "mean", "cls")


class RegistryError(ValueError):
    """The registry file cannot be used; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class ModelEntry:
    """One servable model: the name requests use and how to load it (None: the server's flag)."""

    id: str
    source: str  # folder, .gguf, .mlpackage or hub id ORG/NAME[@REV]; ids may share one
    aliases: tuple[str, ...] = ()
    pinned: bool = False  # loaded at start, never evicted or unloaded when idle
    idle_ttl: float | None = None  # seconds idle before unloading (None: --idle-unload)
    concurrent_requests: int | None = None
    context_length: int | None = None
    keep_quantized: bool | None = None
    pooling: str | None = None
    tool_parser: str | None = None
    cached: bool = field(default=False, compare=False)  # found in the HF cache, not the file

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


def load_registry(path: str | Path) -> list[ModelEntry]:
    """Parse and check a registry file; RegistryError says what is wrong and where."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise RegistryError(f"cannot read the models file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{path} is not valid TOML: {exc}") from None
    tables = data.get("models")
    if not isinstance(tables, list) or not tables:
        raise RegistryError(f"{path} has no [[models]] tables")
    entries = [_entry(t, f"{path}: [[models]] #{i + 1}", path.parent) for i, t in enumerate(tables)]
    check_unique(entries, str(path))
    return entries


def _entry(table: dict, where: str, base: Path) -> ModelEntry:
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise RegistryError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(_FIELDS)})")
    for name in ("id", "source"):
        if not isinstance(table.get(name), str) or not table[name].strip():
            raise RegistryError(f"{where}: {name!r} is required and must be a non-empty string")
    where = f"{where} ({table['id']})"
    for name, kind in _FIELDS.items():
        value = table.get(name)
        if value is None:
            continue
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise RegistryError(f"{where}: {name!r} has the wrong type ({type(value).__name__})")
    aliases = table.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise RegistryError(f"{where}: 'aliases' must be a list of non-empty strings")
    for name in ("concurrent_requests", "context_length"):
        if table.get(name) is not None and table[name] < 1:
            raise RegistryError(f"{where}: {name!r} must be at least 1")
    if table.get("idle_ttl") is not None and table["idle_ttl"] < 0:
        raise RegistryError(f"{where}: 'idle_ttl' must be 0 or more seconds")
    if table.get("pooling") not in (None, *_POOLING):
        raise RegistryError(f"{where}: 'pooling' must be one of {', '.join(_POOLING)}")
    if table.get("tool_parser") not in (None, *PARSERS):
        raise RegistryError(f"{where}: 'tool_parser' must be one of {', '.join(PARSERS)}")
    source = table["source"]
    if source.startswith(("./", "../")):  # relative to the registry file, not the cwd
        source = str((base / source).resolve())
    return ModelEntry(
        id=table["id"],
        source=source,
        aliases=tuple(aliases),
        pinned=table.get("pinned", False),
        idle_ttl=table.get("idle_ttl"),
        concurrent_requests=table.get("concurrent_requests"),
        context_length=table.get("context_length"),
        keep_quantized=table.get("keep_quantized"),
        pooling=table.get("pooling"),
        tool_parser=table.get("tool_parser"),
    )


def check_unique(entries: list[ModelEntry], where: str) -> None:
    """RegistryError when two entries answer to the same name (id or alias)."""
    seen: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if name in seen:
                raise RegistryError(
                    f"{where}: the name {name!r} is used by both {seen[name]!r} and {entry.id!r}"
                )
            seen[name] = entry.id


def cached_entries(known: list[ModelEntry]) -> list[ModelEntry]:
    """An entry for every model repository in the HF cache that no entry already names."""
    from llm_server.models.hub import cached_repos

    names = {n for e in known for n in e.names} | {e.source for e in known}
    return [
        ModelEntry(id=repo.repo_id, source=repo.repo_id, cached=True)
        for repo in cached_repos()
        if repo.repo_id not in names
    ]


def config_dir() -> Path:
    """The user's config folder for llm-server (macOS: ~/Library/Application Support)."""
    import os
    import sys

    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "llm-server"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llm-server"


def default_registry_path() -> Path:
    return config_dir() / "models.toml"
