"""The CLI's security and limit flags reach the app: a real `llm-server` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.helpers import assert_openai_error


@pytest.fixture
def cli_server(tiny_model_path):
    env = {**os.environ, "LLM_SERVER_API_KEY": "env-key-is-overridden"}
    cmd = [
        sys.executable,
        "-c",
        "from llm_server.cli import main; main()",
        "--model",
        str(tiny_model_path),
        "--port",
        "0",
        "--api-key",
        "cli-key",
        "--cors-origin",
        "http://ui.local",
        "--max-body-size",
        "1K",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "ready on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            line = proc.stdout.readline()
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_cli_flags(cli_server):
    url = cli_server
    assert_openai_error(httpx.get(url + "/v1/models"), 401)
    assert_openai_error(
        httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-key-is-overridden"}),
        401,
    )
    auth = {"Authorization": "Bearer cli-key"}
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    err = assert_openai_error(httpx.post(url + "/v1/chat/completions", json=big, headers=auth), 413)
    assert "1024" in err["message"]
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=small, headers=auth).status_code == 200
    pre = httpx.options(
        url + "/v1/models",
        headers={"Origin": "http://ui.local", "Access-Control-Request-Method": "GET"},
    )
    assert pre.headers["access-control-allow-origin"] == "http://ui.local"


def test_concurrent_requests_defaults_to_batching():
    from llm_server.cli import build_parser

    assert build_parser().parse_args([]).concurrent_requests == 4
    assert build_parser().parse_args(["--concurrent-requests", "1"]).concurrent_requests == 1


def test_every_flag_is_in_the_readme_flag_table():
    import argparse
    import re
    from pathlib import Path

    from llm_server.cli import build_parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("| flag | meaning |", 1)[1].split("\n\n", 1)[0]
    flags = [
        flag
        for action in build_parser()._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]
    assert len(flags) > 30
    assert [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", table)] == []
