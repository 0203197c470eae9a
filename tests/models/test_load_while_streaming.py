"""A first request for an unloaded model loads it while another model's stream keeps going."""

from __future__ import annotations

import json
import threading
import time

import httpx

from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer

from .test_on_demand import _complete


def _stream(url: str, stamps: list[float], done: dict) -> None:
    body = {
        "model": "smol",
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8,",
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    stamps.append(time.monotonic())
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    done["finish"] = chunk["choices"][0]["finish_reason"]


def test_first_request_loads_a_model_while_another_streams(default_model_path, tiny_models):
    entries = [
        ModelEntry(id="smol", source=str(default_model_path), pinned=True),
        *(ModelEntry(id=name, source=str(path)) for name, path in tiny_models.items()),
    ]
    with ManagedServer(entries) as srv:
        httpx.post(f"{srv.url}/v1/models/smol/load", timeout=300)
        stamps: list[float] = []
        done: dict = {}
        streamer = threading.Thread(target=_stream, args=(srv.url, stamps, done))
        streamer.start()
        while not stamps and streamer.is_alive():
            time.sleep(0.01)
        started = time.monotonic()
        assert _complete(srv.url, "beta").status_code == 200  # loads beta first
        loaded = time.monotonic()
        streamer.join(300)
    assert done["finish"] == "length"
    during = [t for t in stamps if started <= t <= loaded]
    pairs = list(zip(stamps, stamps[1:], strict=False))
    around = [b - a for a, b in pairs if a >= started - 1 and b <= loaded + 1]
    median = sorted(b - a for a, b in pairs)[len(pairs) // 2]
    print(
        f"\nbeta loaded and answered in {loaded - started:.2f}s; smol streamed {len(during)} "
        f"tokens meanwhile; longest inter-token gap around the load {max(around, default=0):.3f}s"
        f" (median gap {median:.3f}s)"
    )
    assert len(stamps) >= 100  # a token may hold no text yet (a partial character)
    assert during, "the stream produced no token while beta loaded"
