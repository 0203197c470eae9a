"""The Batch API survives kill -9: a real `llm-server` process killed at random points of a batch
and restarted on the same --data-dir finishes it with every line exactly once, and never runs a
line again whose answer was written."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from llm_server.batch.store import Results
from tests.batch.conftest import chat_line, jsonl, read_lines, submit, wait_for

READY = "llm-server ready on "
LINES = 60


class Server:
    """`llm-server` on the tiny model, --port 0, its Batch API data in `data_dir`."""

    def __init__(self, model: Path, data_dir: Path) -> None:
        code = "import sys; from llm_server.cli import main; main(sys.argv[1:])"
        args = ["--model", str(model), "--port", "0", "--concurrent-requests", "4"]
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, *args, "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.output: list[str] = []
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
        if not ready.wait(120) or "url" not in found:
            self.p.kill()
            pytest.fail("server did not start:\n" + "".join(self.output))
        self.url = found["url"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=2)

    def kill9(self) -> None:
        self.p.kill()  # SIGKILL: no drain, no flush
        self.p.wait(10)


def _results(data_dir: Path, batch_id: str) -> list[dict]:
    path = data_dir / "batches" / f"{batch_id}.results.jsonl"
    raw = path.read_bytes() if path.exists() else b""
    return [json.loads(x) for x in raw.split(b"\n")[:-1]]  # whole lines only


def _answered_since_start(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^llm_server_batch_lines_answered_total (\S+)$", text, re.M)[1])


def test_kill9_at_random_points_then_every_line_exactly_once(tiny_model_path, tmp_path):
    rng = random.Random(os.environ.get("BATCH_KILL_SEED", time.time_ns()))
    data = tmp_path / "data"
    lines = [chat_line(f"line-{i}", f"Tell me about {i}", max_tokens=32) for i in range(LINES)]
    server = Server(tiny_model_path, data)
    batch_id = submit(server.client, jsonl(lines)).id
    for _ in range(2):  # kill twice, each at a random number of lines done
        target = rng.randint(1, LINES // 3)
        deadline = time.monotonic() + 60
        while len(_results(data, batch_id)) < target and time.monotonic() < deadline:
            time.sleep(rng.uniform(0, 0.02))
        server.kill9()
        written = {r["index"] for r in _results(data, batch_id)}
        server = Server(tiny_model_path, data)  # resumes the batch on start
    try:
        done = wait_for(server.client, batch_id, timeout=120)
        assert done.status == "completed", done
        assert done.request_counts.completed == LINES and done.request_counts.failed == 0
        out = read_lines(server.client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(LINES))
        indices = [r["index"] for r in _results(data, batch_id)]
        assert sorted(indices) == list(range(LINES))  # each line written exactly once
        # the last server ran only what had no answer when it started
        assert _answered_since_start(server.url) == LINES - len(written)
    finally:
        server.kill9()


def test_a_torn_last_line_is_cut_and_a_line_is_written_once(tmp_path):
    path = tmp_path / "r.jsonl"
    results = Results(path)
    assert results.add(0, {"custom_id": "a"})
    assert results.add(1, {"custom_id": "b"})
    assert not results.add(1, {"custom_id": "b again"})
    results.close()
    with open(path, "ab") as f:
        f.write(b'{"index": 2, "line": {"custom_')  # killed in the middle of the write
    again = Results(path)
    assert set(again.lines) == {0, 1} and again.lines[1] == {"custom_id": "b"}
    assert path.read_bytes().endswith(b"}\n")
    assert again.add(2, {"custom_id": "c"})
    again.close()
    assert [json.loads(x)["index"] for x in path.read_bytes().splitlines()] == [0, 1, 2]


def test_sigterm_during_a_batch_exits_promptly_and_the_batch_resumes(tiny_model_path, tmp_path):
    """A drain does not wait for batch lines: they are dropped and run again after restart."""
    data = tmp_path / "data"
    lines = [chat_line(f"l{i}", f"Story {i}", max_tokens=400, ignore_eos=True) for i in range(12)]
    server = Server(tiny_model_path, data)
    batch_id = submit(server.client, jsonl(lines)).id
    while server.client.batches.retrieve(batch_id).status != "in_progress":
        time.sleep(0.02)
    time.sleep(0.3)  # lines are decoding
    t0 = time.monotonic()
    server.p.send_signal(signal.SIGTERM)
    assert server.p.wait(20) == 0
    assert time.monotonic() - t0 < 10
    server = Server(tiny_model_path, data)
    try:
        done = wait_for(server.client, batch_id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 12
        assert sorted(r["index"] for r in _results(data, batch_id)) == list(range(12))
    finally:
        server.kill9()
