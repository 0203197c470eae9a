"""`llm-server pull / ls / rm` against a local fake hub and a temporary HF cache; `ps` and the
`--models` daemon as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from llm_server.models.memory import format_bytes

from .fake_hub import COMMIT, FakeHub

CODE = "import sys; from llm_server.cli import main; main(sys.argv[1:])"
READY = "llm-server ready on "


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LLM_SERVER_"))}
    return {
        **env,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "home" / ".config"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CODE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_pull_ls_rm_against_a_fake_hub(tmp_path, tiny_models):
    with FakeHub("acme/tiny", tiny_models["alpha"]) as hub:
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        pulled = _cli(env, "pull", "acme/tiny")
    assert pulled.returncode == 0, pulled.stderr
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / COMMIT
    assert pulled.stdout == f"acme/tiny: {snapshot}\n"
    for f in tiny_models["alpha"].iterdir():
        assert (snapshot / f.name).read_bytes() == f.read_bytes()
    offline = _env(tmp_path, HF_HUB_OFFLINE="1")
    listed = _cli(offline, "ls")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["NAME", "WHERE", "SIZE"]
    size = sum(f.stat().st_size for f in tiny_models["alpha"].iterdir())
    assert lines[1].split() == ["acme/tiny", "hf", "cache", format_bytes(size)]
    removed = _cli(offline, "rm", "acme/tiny")
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.startswith("deleted acme/tiny (")
    assert not (tmp_path / "hub" / "models--acme--tiny").exists()
    assert _cli(offline, "ls").stdout.splitlines() == ["NAME  WHERE  SIZE"]
    again = _cli(offline, "rm", "acme/tiny")
    assert again.returncode == 1
    assert again.stderr == "llm-server rm: acme/tiny is not in the Hugging Face cache\n"


def test_pull_of_an_unknown_repo_is_one_line(tmp_path, tiny_models):
    with FakeHub("acme/tiny", tiny_models["alpha"]) as hub:
        done = _cli(_env(tmp_path, HF_ENDPOINT=hub.url), "pull", "acme/other")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "llm-server pull: acme/other is neither a local folder nor a model on the Hugging Face "
        "hub (check the id; private repos need `hf auth login`)"
    ]


def _start(env: dict[str, str], *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-c", CODE, *args, "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    output: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith(READY):
                found["url"] = line[len(READY) :].strip()
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or "url" not in found:
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(output))
    return proc, found["url"], output


def test_models_daemon_ps_and_cached_models(tmp_path, tiny_models):
    hub = tmp_path / "hub"
    with FakeHub("acme/cached", tiny_models["gamma"]) as fake:
        assert _cli(_env(tmp_path, HF_ENDPOINT=fake.url), "pull", "acme/cached").returncode == 0
    registry = tmp_path / "models.toml"
    registry.write_text(
        f'[[models]]\nid = "alpha"\nsource = "{tiny_models["alpha"]}"\npinned = true\n'
        f'[[models]]\nid = "beta"\nsource = "{tiny_models["beta"]}"\naliases = ["b"]\n'
    )
    env = _env(tmp_path, HF_HUB_OFFLINE="1")
    args = ("--models", str(registry), "--models-from-cache", "--max-memory", "1G")
    proc, url, output = _start(env, *args)
    try:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert {k: m["status"] for k, m in models.items()} == {
            "alpha": "loaded",  # pinned: loaded before the ready line
            "beta": "unloaded",
            "acme/cached": "unloaded",
        }
        assert models["acme/cached"]["cached"] is True
        body = {"model": "acme/cached", "prompt": "Hello", "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["model"] == "acme/cached"
        ps = _cli(env, "ps", "--url", url)
        assert ps.returncode == 0, ps.stderr
        rows = [line.split()[:2] for line in ps.stdout.splitlines()]
        assert rows == [["NAME", "STATUS"], ["alpha", "loaded"], ["acme/cached", "loaded"]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert hub.exists()


def test_ps_without_a_daemon_is_one_line(tmp_path):
    done = _cli(_env(tmp_path), "ps", "--url", "http://127.0.0.1:9")
    assert done.returncode == 1
    assert done.stderr.startswith("llm-server ps: no daemon answers at http://127.0.0.1:9 (")


def test_models_flag_errors_are_one_line(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text('[[models]]\nid = "a"\n')
    done = _cli(_env(tmp_path), "--models", str(bad))
    assert done.returncode == 1
    assert (
        done.stderr
        == f"llm-server: {bad}: [[models]] #1: 'source' is required and must be a non-empty string\n"
    )
    both = _cli(_env(tmp_path), "--models", str(bad), "--model", "x")
    assert "does not combine with --model" in both.stderr
    need = "llm-server: --idle-unload and --load-wait need --models FILE\n"
    assert _cli(_env(tmp_path), "--idle-unload", "5").stderr == need
    assert _cli(_env(tmp_path), "--load-wait", "5").stderr == need  # --max-memory alone serves
    negative = _cli(_env(tmp_path), "--models", str(bad), "--load-wait", "-1")
    assert negative.stderr == "llm-server: --load-wait must be 0 or more seconds\n"


def test_ls_lists_the_registry_with_sizes(tmp_path, tiny_models):
    registry = tmp_path / "models.toml"
    registry.write_text(
        f'[[models]]\nid = "alpha"\nsource = "{tiny_models["alpha"]}"\n'
        '[[models]]\nid = "later"\nsource = "acme/not-pulled"\n'
    )
    done = _cli(_env(tmp_path, HF_HUB_OFFLINE="1"), "ls", "--models", str(registry))
    assert done.returncode == 0, done.stderr
    size = format_bytes(sum(f.stat().st_size for f in tiny_models["alpha"].iterdir()))
    assert [line.split() for line in done.stdout.splitlines()] == [
        ["NAME", "WHERE", "SIZE"],
        ["alpha", "registry:", str(tiny_models["alpha"]), size],
        ["later", "registry:", "acme/not-pulled", "-"],
    ]


def test_ls_lists_the_converted_models_the_default_as_default(tmp_path):
    """A new user's `llm-server ls`: the default model converted on first use, other converted
    GGUFs by name, a registry entry serving "default" sized by that folder; partial conversions,
    locks and a stale conversion's key are not the default."""
    from llm_server.default_model import MODEL_NAME, _cache_key, default_gguf_path

    models = tmp_path / "cache" / "models"
    default = models / f"{MODEL_NAME}-{_cache_key(default_gguf_path())}"
    stale = models / f"{MODEL_NAME}-000000000000"
    other = models / "Qwen3-0.6B-Q8_0-0123456789ab"
    for folder, size in ((default, 3000), (stale, 2000), (other, 1000)):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * size)
    (models / f".{other.name}.partial-1").mkdir()
    (models / f"{other.name}.lock").write_text("")
    env = _env(tmp_path, HF_HUB_OFFLINE="1", LLM_SERVER_CACHE=str(tmp_path / "cache"))
    listed = _cli(env, "ls")
    assert listed.returncode == 0, listed.stderr
    assert [line.split() for line in listed.stdout.splitlines()] == [
        ["NAME", "WHERE", "SIZE"],
        ["default", "converted:", str(default), format_bytes(3000)],
        ["Qwen3-0.6B-Q8_0", "converted:", str(other), format_bytes(1000)],
        [MODEL_NAME, "converted:", str(stale), format_bytes(2000)],
    ]
    registry = tmp_path / "models.toml"
    registry.write_text('[[models]]\nid = "smol"\nsource = "default"\n')
    listed = _cli(env, "ls", "--models", str(registry))
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[1] == ["smol", "registry:", "default", format_bytes(3000)]
    assert [r[0] for r in rows[2:]] == ["default", "Qwen3-0.6B-Q8_0", MODEL_NAME]
