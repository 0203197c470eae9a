"""`llm-benchmark --page-poll`: a client doing what the page at `/` does while it is open (its
files once, then GET /ui/api/state once a second), so a load can run with the page open."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

POLL_S = 1.0  # the page's interval (api/ui/static/app.js: POLL_MS)
PAGE_FILES = ("/", "/ui/app.js", "/ui/style.css")


@dataclass
class PollCount:
    polls: int = 0
    failed: int = 0


@contextlib.contextmanager
def polling(url: str, interval: float = POLL_S) -> Iterator[PollCount]:
    """Poll as the open page would until the block ends; yields the running count."""
    count = PollCount()
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            for path in PAGE_FILES:
                client.get(path)
            while not stop.is_set():
                try:
                    ok = client.get("/ui/api/state").status_code == 200
                except httpx.HTTPError:
                    ok = False
                count.polls += 1
                count.failed += not ok
                stop.wait(interval)

    thread = threading.Thread(target=run, name="page-poll", daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join(30)
