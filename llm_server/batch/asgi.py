"""One JSON POST through an ASGI app in this process: how a batch line reaches the same route
handler an interactive request does (same validation, same answer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping

# POST path, JSON body -> (HTTP status, JSON answer)
AppCall = Callable[[str, dict], Awaitable[tuple[int, dict]]]


def app_caller(app, headers: Mapping[str, str] | None = None) -> AppCall:
    """A caller of `app` sending `headers` (an API key) with every request."""
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def call(path: str, body: dict) -> tuple[int, dict]:
        raw = json.dumps(body).encode("utf-8")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("latin-1"),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"batch"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode("latin-1")),
                *extra,
            ],
            "client": ("127.0.0.1", 0),
            "server": ("batch", 80),
        }
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the "client" never goes away; cancelling ends it
            return {"type": "http.disconnect"}

        status = 500
        chunks: list[bytes] = []

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await app(scope, receive, send)
        try:
            answer = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            answer = {"error": {"message": b"".join(chunks).decode("utf-8", "replace")}}
        return status, answer if isinstance(answer, dict) else {"data": answer}

    return call
