"""The Hugging Face cache as `llm-server pull / ls / rm` see it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llm_server.model_source import ModelSourceError, download_hub_model, parse_hub_id


@dataclass(frozen=True)
class CachedRepo:
    repo_id: str
    size: int  # bytes on disk
    path: Path  # the repository's cache folder


def cached_repos() -> list[CachedRepo]:
    """Every model repository in the HF cache, by id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    repos = [r for r in info.repos if r.repo_type == "model"]
    return sorted(
        (CachedRepo(r.repo_id, r.size_on_disk, Path(r.repo_path)) for r in repos),
        key=lambda r: r.repo_id,
    )


def pull(name: str) -> Path:
    """Download ORG/NAME[@REV] into the HF cache (progress bars on stderr); its snapshot."""
    hub = parse_hub_id(name)
    if hub is None:
        raise ModelSourceError(f"{name!r} is not a Hugging Face id (ORG/NAME[@REVISION])")
    return download_hub_model(hub)


def remove(name: str) -> CachedRepo:
    """Delete ORG/NAME (every revision) from the HF cache; ModelSourceError when absent."""
    from huggingface_hub import scan_cache_dir

    hub = parse_hub_id(name)
    repo_id = hub.repo_id if hub is not None else name
    found = [r for r in cached_repos() if r.repo_id == repo_id]
    if not found:
        raise ModelSourceError(f"{repo_id} is not in the Hugging Face cache")
    info = scan_cache_dir()
    revisions = [
        rev.commit_hash
        for repo in info.repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for rev in repo.revisions
    ]
    strategy = info.delete_revisions(*revisions)
    strategy.execute()
    if found[0].path.exists():  # no revision left but refs or blobs: the folder goes too
        import shutil

        shutil.rmtree(found[0].path, ignore_errors=True)
    return found[0]
