"""A registry entry whose files are broken fails to load with the file named and what is wrong
with it (not a safetensors file, truncated, shapes or layers that are not config.json's), before
any other model is evicted for it; the other models keep serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from llm_server.models.checkpoint import CheckpointError, check_checkpoint
from llm_server.models.memory import estimate_size
from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer

from .test_on_demand import _complete, _statuses

WEIGHTS = "model.safetensors"


def _garbage(d: Path) -> None:
    (d / WEIGHTS).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 16)


def _lfs_pointer(d: Path) -> None:
    (d / WEIGHTS).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")


def _empty(d: Path) -> None:
    (d / WEIGHTS).write_bytes(b"")


def _truncated(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


def _not_json(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[:8] + b"\xff" * 16 + data[24:])


def _config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))


def _wider(d: Path) -> None:
    _config(d, hidden_size=128)


def _more_layers(d: Path) -> None:
    _config(d, num_hidden_layers=3)


CASES = {  # how the checkpoint is broken -> what the message says (after the file's path)
    _garbage: "is not a safetensors file: its first 8 bytes give a header of 727905341920923785 "
    "bytes but the file has 4104 bytes",
    _lfs_pointer: "a Git LFS pointer, not the weights: run `git lfs pull`",
    _empty: "is not a safetensors file: 0 bytes, too short for its 8-byte header length",
    _truncated: "is truncated: ",
    _not_json: "has no safetensors header: its ",
    _wider: ": tensor 'lm_head.weight' has shape [384, 64] but config.json (qwen2: vocab_size 384, "
    "hidden_size 128, intermediate_size 128) makes it [384, 128]: the weights and config.json "
    "come from different models",
    _more_layers: "hold 2 layers under 'model.layers' but config.json asks for 3 "
    "(num_hidden_layers 3): a weights file is missing, or config.json comes from another model",
}


def _broken(tiny_models, tmp_path: Path, breaks) -> Path:
    folder = shutil.copytree(tiny_models["gamma"], tmp_path / breaks.__name__.strip("_"))
    breaks(folder)
    return folder


@pytest.mark.parametrize("breaks", list(CASES), ids=lambda f: f.__name__.strip("_"))
def test_each_broken_checkpoint_is_named_with_what_is_wrong(tiny_models, tmp_path, breaks):
    folder = _broken(tiny_models, tmp_path, breaks)
    with pytest.raises(CheckpointError) as caught:
        check_checkpoint(folder)
    message = str(caught.value)
    assert CASES[breaks] in message
    named = folder / WEIGHTS if breaks not in (_more_layers,) else WEIGHTS
    assert str(named) in message
    if breaks not in (_wider, _more_layers):  # the size estimate reads the same headers
        with pytest.raises(CheckpointError):
            estimate_size(folder, 1, None)


def test_intact_checkpoints_pass(tiny_models):
    for folder in tiny_models.values():
        check_checkpoint(folder)


def test_a_broken_model_fails_before_evicting_and_the_others_serve_on(tiny_models, tmp_path):
    broken = _broken(tiny_models, tmp_path, _garbage)
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"])),
        ModelEntry(id="broken", source=str(broken)),
    ]
    budget = estimate_size(tiny_models["alpha"], 1, None).needed  # room for alpha alone
    with ManagedServer(entries, budget=budget) as srv:
        good = _complete(srv.url, "alpha").json()["choices"]
        failed = _complete(srv.url, "broken")
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed"
        assert error["message"] == (
            f"model 'broken' failed to load: {broken / WEIGHTS} {CASES[_garbage]}"
        )
        models = {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]}
        assert models["broken"]["error"] == f"{broken / WEIGHTS} {CASES[_garbage]}"
        assert _statuses(srv.url) == {"alpha": "loaded", "broken": "unloaded"}  # not evicted
        assert _complete(srv.url, "alpha").json()["choices"] == good
