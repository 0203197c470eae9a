"""--log-requests in a real `llm-server` process: a request in flight at SIGTERM still gets its line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx

from llm_server.native.blas import preload_env

LONG_PROMPT = "What is the capital of France?"  # the tiny model runs to the token limit on it


def test_sigterm_drains_and_keeps_every_line(tiny_model_path, tmp_path) -> None:
    log_path = tmp_path / "requests.jsonl"
    cmd = [
        sys.executable, "-c", "from llm_server.cli import main; main()",
        "--model", str(tiny_model_path), "--port", "0", "--log-requests", str(log_path),
        "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=preload_env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("llm-server ready on "), line
        url = line.split()[-1]
        with httpx.Client(base_url=url, timeout=120) as client:
            short = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
            assert client.post("/v1/completions", json=short).status_code == 200
            body = {
                "messages": [{"role": "user", "content": LONG_PROMPT}],
                "max_tokens": 600,
                "temperature": 0,
                "stream": True,
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                chunks = resp.iter_text()
                next(chunks)  # the stream has started: the request is in flight
                proc.send_signal(signal.SIGTERM)
                rest = "".join(chunks)
        assert rest.rstrip().endswith("data: [DONE]")
        proc.wait(60)  # the exit status belongs to the graceful-shutdown tests
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    entries = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert [e["endpoint"] for e in entries] == ["/v1/completions", "/v1/chat/completions"]
    streamed = entries[1]
    assert streamed["status"] == 200 and streamed["stream"] is True
    assert streamed["response"]["choices"][0]["finish_reason"] == "length"
    assert streamed["response"]["usage"]["completion_tokens"] == 600
