"""`--model ORG/NAME`: a real `llm-server` process on a checkpoint laid out as a Hugging Face
cache (HF_HUB_OFFLINE=1), and the one-line error when the id is not cached."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from llm_server.model_source import HubId, parse_hub_id

READY = "llm-server ready on "
CODE = "import sys; from llm_server.cli import main; main(sys.argv[1:])"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(root: Path, repo_id: str, checkpoint: Path) -> Path:
    """Lay `checkpoint` out as huggingface_hub does: blobs, a snapshot of links, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _start(env: dict[str, str], model: str) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-c", CODE, "--model", model, "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    output: list[str] = []
    found: dict[str, str] = {}
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith(READY):
                found["url"] = line[len(READY) :].strip()
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(120) or "url" not in found:
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(output))
    return proc, found["url"], output


@pytest.mark.parametrize("network", ["HF_HUB_OFFLINE=1", "hub unreachable"])
def test_hub_id_served_from_the_hf_cache_without_network(tmp_path, tiny_llama_path, network):
    cache = tmp_path / "hub"
    _hf_cache(cache, "acme/tiny-llama", tiny_llama_path)
    env = _env(cache)
    if network == "hub unreachable":  # online mode, but the cache is read first
        del env["HF_HUB_OFFLINE"]
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the discard port: nothing listens
    proc, url, output = _start(env, "acme/tiny-llama")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            models = c.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["acme/tiny-llama"]
            health = c.get("/health").json()  # started without --concurrent-requests
            assert health["batching"] is True and health["concurrent_requests"] == 4
            r = c.post(
                "/v1/completions",
                json={"model": "acme/tiny-llama", "prompt": "Hello", "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "acme/tiny-llama"
            assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.kill()
        proc.wait(10)
    assert not any("Traceback" in line for line in output), "".join(output)


def test_hub_id_not_cached_offline_is_one_line_and_exit_2(tmp_path):
    cache = tmp_path / "empty-hub"
    cmd = [sys.executable, "-c", CODE, "--model", "acme/not-cached@v1", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(cache), timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("llm-server: acme/not-cached@v1 is not in the Hugging Face cache ")
    assert str(cache) in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "hf download acme/not-cached" in lines[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("acme/tiny", HubId("acme/tiny", None)),
        ("mlx-community/Qwen3-4B-4bit@main", HubId("mlx-community/Qwen3-4B-4bit", "main")),
        ("acme/tiny@" + COMMIT, HubId("acme/tiny", COMMIT)),
        ("./acme/tiny", None),
        ("/models/acme", None),
        ("~/acme/tiny", None),
        ("model.gguf", None),
        ("a/b/c", None),
    ],
)
def test_parse_hub_id(text, expected):
    assert parse_hub_id(text) == expected


def test_existing_relative_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("acme/tiny") is None


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """A hub endpoint that knows no repository (what huggingface.co answers for an unknown id)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


def test_unknown_hub_id_online_is_one_line_and_exit_2(tmp_path):
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        env = {**_env(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}"}
        del env["HF_HUB_OFFLINE"]
        cmd = [sys.executable, "-c", CODE, "--model", "acme/no-such-model", "--port", "0"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        hub.shutdown()
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines == [
        "llm-server: acme/no-such-model is neither a local folder nor a model on the Hugging "
        "Face hub (check the id; private repos need `hf auth login`)"
    ], done.stderr
