"""What `--model` names and which engine serves it: a local folder, `.gguf` or `.mlpackage`,
or a Hugging Face hub id.

A hub id (`ORG/NAME` or `ORG/NAME@REVISION`) resolves through huggingface_hub into the standard
HF cache (`HF_HOME` / `HF_HUB_CACHE` honoured): the cached snapshot first, with no network (so
`HF_HUB_OFFLINE=1` works), else a download with huggingface_hub's progress bars.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# What an MLX/HF checkpoint needs to serve (mlx-lm downloads the same set): no PyTorch .bin,
# no ONNX or GGUF copies some repositories carry too.
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
# ORG/NAME as the hub spells them, then an optional @branch, tag or commit
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


class ModelSourceError(ValueError):
    """`--model` cannot be served; the message is one line saying what to do."""


@dataclass(frozen=True)
class HubId:
    repo_id: str  # ORG/NAME
    revision: str | None  # branch, tag or commit; None: main


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the folder (or converted GGUF folder, or .mlpackage) to load
    model_id: str  # what /v1/models reports


def parse_hub_id(text: str) -> HubId | None:
    """`ORG/NAME[@REVISION]` -> HubId; None for anything that is (or looks like) a local path."""
    if text.startswith((".", "/", "~")) or Path(text).expanduser().exists():
        return None
    match = _HUB_ID.match(text)
    if match is None:
        return None
    return HubId(match["repo"], match["revision"])


def hub_cache_dir() -> str:
    """The cache huggingface_hub reads and writes (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def download_hub_model(hub: HubId) -> Path:
    """The snapshot folder of `hub` in the HF cache, downloaded when not cached.

    Raises ModelSourceError (one line: which id, which cache, what to do) when it is not cached
    and cannot be downloaded.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = hub.repo_id + (f"@{hub.revision}" if hub.revision else "")
    cache = hub_cache_dir()
    kwargs = {"revision": hub.revision, "allow_patterns": ALLOW_PATTERNS}
    try:
        return Path(snapshot_download(hub.repo_id, local_files_only=True, **kwargs))
    except HFValidationError as exc:
        raise ModelSourceError(f"{name!r} is not a valid Hugging Face model id: {exc}") from None
    except LocalEntryNotFoundError:
        pass  # not cached (or partly): download it
    if constants.HF_HUB_OFFLINE:
        raise ModelSourceError(
            f"{name} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: "
            f"download it first with `hf download {hub.repo_id}` (network needed), "
            "or pass a local model folder"
        )
    try:
        return Path(snapshot_download(hub.repo_id, **kwargs))
    except GatedRepoError:
        reason = "is gated: accept its terms on huggingface.co and run `hf auth login`"
    except RepositoryNotFoundError:
        reason = (
            "is neither a local folder nor a model on the Hugging Face hub "
            "(check the id; private repos need `hf auth login`)"
        )
    except RevisionNotFoundError:
        reason = f"has no revision {hub.revision!r} on the Hugging Face hub"
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"could not be downloaded into {cache} ({first}); check the network"
    raise ModelSourceError(f"{name} {reason}")


def resolve_model_source(model: str | None) -> ModelSource:
    """The folder to serve for `--model` and the id to report; ModelSourceError when unusable."""
    if model is None:
        from llm_server.default_model import MODEL_NAME, default_model_path

        return ModelSource(default_model_path(), MODEL_NAME)
    hub = parse_hub_id(model)
    if hub is not None:
        path = download_hub_model(hub)
        _check_folder(path, f"{model} (snapshot {path})")
        return ModelSource(path, model)  # the id as typed, revision included
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model path {path} does not exist (a Hugging Face id looks like ORG/NAME)"
        )
    if path.is_file() and path.suffix == ".gguf":
        from llm_server.default_model import converted_gguf_path

        return ModelSource(converted_gguf_path(path), path.stem)
    if path.suffix == ".mlpackage":
        return ModelSource(path, path.stem)
    if path.is_dir() and any(path.glob("*.mlpackage")):
        return ModelSource(path, path.name)
    _check_folder(path, str(path))
    return ModelSource(path, path.name)


def _check_folder(path: Path, shown: str) -> None:
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        raise ModelSourceError(f"{shown} is not a model folder (it needs config.json)")
    if not os.access(config, os.R_OK):
        raise ModelSourceError(f"{config} is not readable")


def source_or_exit(model: str | None) -> ModelSource:
    """resolve_model_source() for a command line: exits (status 2) with one line on stderr."""
    try:
        return resolve_model_source(model)
    except ModelSourceError as exc:
        print(f"llm-server: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def resolve_model(model: str | None) -> Path:
    """The model folder to serve; exits with one line when it is unusable."""
    return source_or_exit(model).path


def pick_backend(model_path: Path, backend: str = "auto") -> str:
    """'coreml' for a Core ML package (or a folder holding one), else 'mlx'; or as asked."""
    if backend != "auto":
        return backend
    if model_path.suffix == ".mlpackage" or any(model_path.glob("*.mlpackage")):
        return "coreml"
    return "mlx"
