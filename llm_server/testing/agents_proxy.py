"""A recording HTTP proxy between a real agent and the server (tests/agents).

Every request is forwarded unchanged to `upstream` and recorded (method, path, JSON body,
status, the response bytes, streamed or not), except that `force_tool` rewrites the FIRST
request that offers that tool so its `tool_choice` names it, in the shape of its API: that
is how a test makes an agent with a random-weight model run one of its own tools. Where the
arguments matter (Claude Code's Read on a given PNG), `canned_call` answers the FIRST
Messages request offering that tool itself, with a `tool_use` of those arguments (a Responses
request, Codex's view_image: a `function_call`), and the agent's next request (the tool's
result) goes to the server as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llm_server.listen import tcp_socket


class _ServerThread:
    """uvicorn serving `app` on a free loopback port in a daemon thread."""

    def __init__(self, app, name: str) -> None:
        self._sock = tcp_socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        serve = self.server.serve
        self._thread = threading.Thread(
            target=lambda: asyncio.run(serve(sockets=[self._sock])), name=name, daemon=True
        )

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("proxy did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    method: str
    path: str
    body: dict | None
    status: int = 0
    response: bytes = b""
    forced: bool = False

    def events(self) -> list[dict]:
        """The JSON payloads of an SSE response's `data:` lines (or the one JSON body)."""
        text = self.response.decode(errors="replace")
        if not text.lstrip().startswith(("event:", "data:")):
            try:
                return [json.loads(text)]
            except json.JSONDecodeError:
                return []
        out = []
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line[5:]))
        return out


def tool_names(path: str, body: dict) -> list[str]:
    """The function names a request offers (chat, Responses or Messages shape)."""
    names = []
    for tool in body.get("tools") or []:
        if "/chat/completions" in path:
            names.append((tool.get("function") or {}).get("name"))
        elif tool.get("type") in ("function", None, "custom") or "input_schema" in tool:
            names.append(tool.get("name"))
    return [n for n in names if n]


def forced_choice(path: str, name: str) -> dict:
    """`tool_choice` naming `name` in the API of `path`."""
    if path.endswith("/messages"):
        return {"type": "tool", "name": name}
    if path.endswith("/responses"):
        return {"type": "function", "name": name}
    return {"type": "function", "function": {"name": name}}


@dataclass
class RecordingProxy:
    """Serve on 127.0.0.1:<free port>, forwarding to `upstream`; a context manager."""

    upstream: str
    force_tool: str | list[str] | None = None
    canned_call: tuple[str, dict] | None = None  # (tool, arguments): Messages or Responses
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._forced = False
        app = Starlette(
            routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE", "HEAD"])]
        )
        self._server = _ServerThread(app, name="agent-proxy")
        self.url = self._server.url

    def _maybe_force(self, path: str, body: dict | None) -> bool:
        if self.force_tool is None or body is None or self._forced:
            return False
        wanted = [self.force_tool] if isinstance(self.force_tool, str) else self.force_tool
        offered = tool_names(path, body)
        name = next((n for n in wanted if n in offered), None)
        if name is None:
            return False
        with self._lock:
            if self._forced:
                return False
            self._forced = True
        body["tool_choice"] = forced_choice(path, name)
        return True

    def _canned(self, path: str, body: dict) -> bytes | None:
        """The canned `tool_use` (Messages) or `function_call` (Responses) answer to the first
        request offering the tool."""
        if self.canned_call is None or not path.endswith(("/messages", "/responses")):
            return None
        name, arguments = self.canned_call
        if name not in tool_names(path, body):
            return None
        with self._lock:
            if self._forced:
                return None
            self._forced = True
        if path.endswith("/responses"):
            return canned_function_call(body, name, arguments)
        return canned_tool_use(body, name, arguments)

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = None
        path = request.url.path
        ex = Exchange(request.method, path, body)
        canned = self._canned(path, body) if isinstance(body, dict) else None
        if canned is not None:
            ex.forced, ex.status, ex.response = True, 200, canned
            self.exchanges.append(ex)
            kind = "text/event-stream" if body.get("stream") else "application/json"
            return Response(canned, media_type=kind)
        ex.forced = self._maybe_force(path, body) if isinstance(body, dict) else False
        if ex.forced:
            raw = json.dumps(body).encode()
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
        url = self.upstream + path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await client.send(
            client.build_request(request.method, url, headers=headers, content=raw), stream=True
        )
        ex.status = upstream.status_code
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    ex.response += chunk
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)

    def model_calls(self) -> list[Exchange]:
        """The generation requests (chat, Responses, Messages), in order."""
        ends = ("/chat/completions", "/responses", "/messages")
        return [e for e in self.exchanges if e.method == "POST" and e.path.endswith(ends)]

    def start(self) -> RecordingProxy:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def canned_tool_use(body: dict, name: str, arguments: dict) -> bytes:
    """A Messages answer calling `name` with `arguments`: SSE events when `body` streams,
    else the one message."""
    block = {"type": "tool_use", "id": "toolu_canned_1", "name": name, "input": arguments}
    usage = {"input_tokens": 1, "output_tokens": 1}
    message = {
        "id": "msg_canned", "type": "message", "role": "assistant", "model": body.get("model"),
        "content": [block], "stop_reason": "tool_use", "stop_sequence": None, "usage": usage,
    }  # fmt: skip
    if not body.get("stream"):
        return json.dumps(message).encode()
    events = [
        ("message_start", {"type": "message_start",
                           "message": {**message, "content": [], "stop_reason": None}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {**block, "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "input_json_delta",
                                           "partial_json": json.dumps(arguments)}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events).encode()


def canned_function_call(body: dict, name: str, arguments: dict) -> bytes:
    """A Responses answer calling `name` with `arguments`: SSE events when `body` streams,
    else the one response object."""
    item = {
        "type": "function_call",
        "id": "fc_canned_1",
        "call_id": "call_canned_1",
        "name": name,
        "arguments": json.dumps(arguments),
        "status": "completed",
    }
    usage = {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2,
    }
    response = {"id": "resp_canned", "object": "response", "created_at": int(time.time()),
                "status": "completed", "model": body.get("model"), "output": [item],
                "usage": usage}  # fmt: skip
    if not body.get("stream"):
        return json.dumps(response).encode()
    events = [
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": {**response, "status": "in_progress", "output": [],
                                           "usage": None}}),
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "sequence_number": 1, "output_index": 0,
                                        "item": {**item, "status": "in_progress",
                                                 "arguments": ""}}),
        ("response.function_call_arguments.done", {
            "type": "response.function_call_arguments.done", "sequence_number": 2,
            "item_id": item["id"], "output_index": 0, "arguments": item["arguments"]}),
        ("response.output_item.done", {"type": "response.output_item.done",
                                       "sequence_number": 3, "output_index": 0, "item": item}),
        ("response.completed", {"type": "response.completed", "sequence_number": 4,
                                "response": response}),
    ]  # fmt: skip
    return "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events).encode()


def answer_text(ex: Exchange) -> str:
    """The text an answer carried (chat, Responses or Messages; streamed or not)."""
    parts = []
    for ev in ex.events():
        kind = ev.get("type", "")
        if kind == "response.output_text.delta":
            parts.append(ev.get("delta", ""))
        elif kind == "content_block_delta" and ev["delta"].get("type") == "text_delta":
            parts.append(ev["delta"]["text"])
        elif ev.get("object") == "chat.completion.chunk":
            parts += [(c.get("delta") or {}).get("content") or "" for c in ev["choices"]]
        elif ev.get("object") == "chat.completion":
            parts += [c["message"].get("content") or "" for c in ev["choices"]]
        elif ev.get("object") == "response":
            for item in ev.get("output", []):
                parts += [c.get("text", "") for c in item.get("content") or []]
        elif kind == "message":
            parts += [b.get("text", "") for b in ev.get("content", []) if b["type"] == "text"]
    return "".join(parts)


def prompt_usage(ex: Exchange) -> tuple[int, int]:
    """(prompt tokens, of which cached) that an answer reported."""
    for ev in reversed(ex.events()):
        usage = ev.get("usage") or (ev.get("response") or {}).get("usage")
        if not usage and ev.get("type") == "message_start":
            usage = ev["message"]["usage"]
        if not usage:
            continue
        if "prompt_tokens" in usage:
            return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        if "cache_read_input_tokens" in usage and "input_tokens" in usage:
            read = usage["cache_read_input_tokens"] or 0
            made = usage.get("cache_creation_input_tokens") or 0
            return usage["input_tokens"] + read + made, read
        if "input_tokens_details" in usage:
            return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    raise ValueError(f"no usage in the answer to {ex.path}")


def call_ids(ex: Exchange) -> list[str]:
    """The ids of the tool calls an answer made."""
    ids = []
    for ev in ex.events():
        item = ev.get("item") or {}
        if ev.get("type") == "response.output_item.done" and item.get("type") == "function_call":
            ids.append(item["call_id"])
        block = ev.get("content_block") or {}
        if ev.get("type") == "content_block_start" and block.get("type") == "tool_use":
            ids.append(block["id"])
        for choice in ev.get("choices", []):
            for call in (choice.get("delta") or choice.get("message") or {}).get(
                "tool_calls"
            ) or []:
                if call.get("id"):
                    ids.append(call["id"])
    return ids


def tool_results(ex: Exchange) -> list[str]:
    """The call ids whose results a request sends back."""
    body = ex.body or {}
    out = []
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if item.get("type") == "function_call_output":
            out.append(item["call_id"])
    for msg in body.get("messages") or []:
        if msg.get("role") == "tool":
            out.append(msg.get("tool_call_id"))
        if isinstance(msg.get("content"), list):
            out += [b["tool_use_id"] for b in msg["content"] if b.get("type") == "tool_result"]
    return out


def calls_made(ex: Exchange) -> list[tuple[str, dict]]:
    """(name, parsed arguments) of each tool call an answer made, as the client assembles it."""
    out: list[tuple[str, dict]] = []
    chat: dict[int, list[str]] = {}
    blocks: dict[int, list[str]] = {}
    for ev in ex.events():
        item = ev.get("item") or {}
        if ev.get("type") == "response.output_item.done" and item.get("type") == "function_call":
            out.append((item["name"], json.loads(item["arguments"])))
        block = ev.get("content_block") or {}
        if ev.get("type") == "content_block_start" and block.get("type") == "tool_use":
            blocks[ev["index"]] = [
                block["name"],
                json.dumps(block["input"]) if block["input"] else "",
            ]
        delta = ev.get("delta") or {}
        if ev.get("type") == "content_block_delta" and delta.get("type") == "input_json_delta":
            blocks[ev["index"]][1] += delta["partial_json"]
        for choice in ev.get("choices", []):
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                entry = chat.setdefault(call["index"], ["", ""])
                entry[0] += (call.get("function") or {}).get("name") or ""
                entry[1] += (call.get("function") or {}).get("arguments") or ""
    out += [(name, json.loads(args or "{}")) for name, args in blocks.values()]
    out += [(name, json.loads(args or "{}")) for name, args in chat.values()]
    return out


def tool_schema(path: str, body: dict, name: str) -> dict:
    """The parameters schema a request gives function `name`."""
    for tool in body.get("tools") or []:
        fn = tool.get("function") or tool
        if fn.get("name") == name:
            return fn.get("parameters") or fn.get("input_schema") or {}
    raise KeyError(name)
