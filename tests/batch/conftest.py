"""Batch API fixtures: one live server per module on the tiny model, its data in a temp dir."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import openai
import pytest

MAX_FILE_BYTES = 64 * 1024  # the test server's --max-file-size


@pytest.fixture(scope="module")
def batch_server(tiny_model_path: Path, tmp_path_factory):
    from llm_server.testing.live import serving

    data = tmp_path_factory.mktemp("batch-data")
    options = {"data_dir": data, "max_file_bytes": MAX_FILE_BYTES}
    with serving(tiny_model_path, concurrent=4, max_queued=2, app_options=options) as srv:
        yield srv


@pytest.fixture
def client(batch_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=batch_server.url + "/v1", api_key="unused", max_retries=0)


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def chat_line(custom_id: str, text: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions"):
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def wait_for(client: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    """Poll until the batch reaches a final status; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]
