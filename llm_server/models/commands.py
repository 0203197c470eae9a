"""`llm-server ls | ps | pull | rm | service`: the models on disk and in a running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from llm_server.model_source import ModelSourceError
from llm_server.models.memory import format_bytes
from llm_server.models.registry import RegistryError, default_registry_path, load_registry

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "LLM_SERVER_URL"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-server", description=__doc__)
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser(
        "ls", help="models in the registry file, the converted-model cache and the HF cache"
    )
    ls.add_argument(
        "--models", metavar="FILE", help=f"registry (default {default_registry_path()})"
    )
    ps = verbs.add_parser("ps", help="what a running daemon has loaded (from its API)")
    ps.add_argument("--url", help=f"the daemon (default env {URL_ENV}, else {DEFAULT_URL})")
    ps.add_argument("--api-key", help="its API key (default env LLM_SERVER_API_KEY)")
    pull = verbs.add_parser("pull", help="download ORG/NAME[@REVISION] into the HF cache")
    pull.add_argument("name")
    rm = verbs.add_parser("rm", help="delete ORG/NAME from the Hugging Face cache")
    rm.add_argument("name")
    service = verbs.add_parser("service", help="the login service (launchd / systemd --user)")
    service.add_argument("action", choices=["install", "uninstall", "status"])
    service.add_argument("--port", type=int, default=8080, help="its port (default 8080)")
    service.add_argument(
        "--models", metavar="FILE", help=f"registry (default {default_registry_path()})"
    )
    service.add_argument("--no-start", action="store_true", help="write the files, start nothing")
    return p


def run_verb(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"ls": ls, "ps": ps, "pull": pull, "rm": rm, "service": service}[args.verb](args)
    except (ModelSourceError, RegistryError, OSError) as exc:
        print(f"llm-server {args.verb}: {exc}", file=sys.stderr)
        return 1


def ls(args: argparse.Namespace) -> int:
    """Registered models (with their source's size on disk), the models converted into
    llm-server's cache (the default model among them, named `default`), then the HF cache."""
    from llm_server.default_model import converted_models
    from llm_server.models.hub import cached_repos

    registry = Path(args.models).expanduser() if args.models else default_registry_path()
    converted = converted_models()
    cached = cached_repos()
    sizes = {repo.repo_id: format_bytes(repo.size) for repo in cached}
    for model in converted:
        if model.default:  # a registry entry with source "default" serves this folder
            sizes["default"] = _disk(str(model.path))
    rows = [("NAME", "WHERE", "SIZE")]
    if args.models or registry.is_file():
        for entry in load_registry(registry):
            hub = entry.source.split("@", 1)[0]  # a hub id's size: its cache folder's
            size = sizes.get(hub) or _disk(entry.source)
            rows.append((entry.id, f"registry: {entry.source}", size))
    for model in converted:
        name = "default" if model.default else model.name
        rows.append((name, f"converted: {model.path}", _disk(str(model.path))))
    for repo in cached:
        rows.append((repo.repo_id, "hf cache", sizes[repo.repo_id]))
    _table(rows)
    return 0


def ps(args: argparse.Namespace) -> int:
    """The daemon's models that are loaded or loading."""
    url = (args.url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    key = args.api_key or os.environ.get("LLM_SERVER_API_KEY")
    request = urllib.request.Request(f"{url}/v1/models")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            models = json.load(response)["data"]
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"llm-server ps: no daemon answers at {url} ({reason})", file=sys.stderr)
        return 1
    rows = [("NAME", "STATUS", "SIZE", "ACTIVE", "LAST USED")]
    for m in models:
        if m.get("status", "loaded") not in ("loaded", "loading", "unloading"):
            continue
        size = m.get("size_bytes")
        used = m.get("last_used")
        rows.append(
            (
                m["id"],
                m.get("status", "loaded"),
                format_bytes(size) if size else "-",
                str(m.get("active_requests", 0)),
                f"{int(time.time() - used)}s ago" if used else "-",
            )
        )
    _table(rows)
    return 0


def pull(args: argparse.Namespace) -> int:
    from llm_server.models.hub import pull as download

    path = download(args.name)
    print(f"{args.name}: {path}")
    return 0


def rm(args: argparse.Namespace) -> int:
    from llm_server.models.hub import remove

    repo = remove(args.name)
    print(f"deleted {repo.repo_id} ({format_bytes(repo.size)})")
    return 0


def service(args: argparse.Namespace) -> int:
    from llm_server.models import login_service

    return login_service.run(args)


def _disk(source: str) -> str:
    path = Path(source).expanduser()
    if not path.exists():
        return "-"
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return format_bytes(sum(f.stat().st_size for f in files))


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
