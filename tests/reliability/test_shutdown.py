"""Graceful shutdown of a real `llm-server` process: SIGTERM stops admitting (503), running
requests finish, the request log is complete, and the process exits 0; a second SIGTERM exits
at once (status 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from llm_server.server import MAX_HEADER_BYTES

COMP = "/v1/completions"
LONG = {"prompt": "The capital of France is", "max_tokens": 900, "temperature": 0}  # no EOS
READY = "llm-server ready on "


class Proc:
    """`llm-server` on the tiny model with --port 0; `url` once it printed its ready line."""

    def __init__(self, model: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "llm_server.cli", "--model", str(model), "--port", "0"]
        code = "import sys; from llm_server.cli import main; main(sys.argv[1:])"
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, *cmd[3:], "--log-level", "warning", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.output: list[str] = []
        self.url = self._wait_ready(120)

    def _wait_ready(self, timeout: float) -> str:
        found: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            for line in self.p.stdout:
                self.output.append(line)
                if line.startswith(READY):
                    found["url"] = line[len(READY) :].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or "url" not in found:
            self.p.kill()
            pytest.fail("server did not start:\n" + "".join(self.output))
        return found["url"]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def _stream(url: str, started: threading.Event, out: dict) -> None:
    """Stream LONG; set `started` after the first token; keep the text and whether it ended."""
    text, done = [], False
    try:
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", url + COMP, json={**LONG, "stream": True}) as r,
        ):
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:])["choices"]
                    text.append(choices[0]["text"] if choices else "")
                    if len(text) == 2:
                        started.set()
    except httpx.TransportError as exc:  # the forced exit cuts the stream
        out["error"] = exc
    out["text"], out["done"] = "".join(text), done
    started.set()


def test_sigterm_drains_then_exits_zero(tiny_model_path, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    proc = Proc(tiny_model_path, "--concurrent-requests", "2", "--log-requests", str(log_path))
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as c:
            try:  # h11 answers 400 and closes, often while the client is still sending
                big = c.get("/health", headers={"x-padding": "a" * (64 * MAX_HEADER_BYTES)})
                assert big.status_code == 400
            except httpx.TransportError:
                pass
            assert c.get("/health").status_code == 200
            ref = c.post(COMP, json=LONG).json()
            assert ref["usage"]["completion_tokens"] > 50, "the reference ends too soon to drain"
            outs = [{}, {}]
            starts = [threading.Event(), threading.Event()]
            threads = [
                threading.Thread(target=_stream, args=(proc.url, s, o))
                for s, o in zip(starts, outs, strict=True)
            ]
            for t in threads:
                t.start()
            for s in starts:
                assert s.wait(60)
            proc.p.send_signal(signal.SIGTERM)
            time.sleep(0.1)  # the signal is handled between two bytecodes of the main thread
            assert proc.p.poll() is None, "exited before the running requests finished"
            refused = c.post(COMP, json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert c.get("/health").json()["status"] == "draining"
            for t in threads:
                t.join(120)
        for out in outs:
            assert out["status"] == 200 and out["done"], out
            assert out["text"] == ref["choices"][0]["text"]
        assert proc.p.wait(60) == 0, "".join(proc.output)
    finally:
        proc.kill()
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    streamed = [e for e in entries if e["stream"]]
    assert len(streamed) == 2, entries
    for e in streamed:
        assert e["status"] == 200
        assert e["response"]["choices"][0]["text"] == ref["choices"][0]["text"]


def test_second_sigterm_exits_at_once(tiny_model_path):
    proc = Proc(tiny_model_path, "--drain-timeout", "600")
    try:
        started, out = threading.Event(), {}
        t = threading.Thread(target=_stream, args=(proc.url, started, out), daemon=True)
        t.start()
        assert started.wait(60)
        proc.p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.p.send_signal(signal.SIGTERM)
        assert proc.p.wait(10) == 1
        assert time.monotonic() - t0 < 5
        t.join(10)
        assert not out["done"], "the stream should have been cut, not finished"
    finally:
        proc.kill()
