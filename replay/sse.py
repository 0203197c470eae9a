"""Server-sent event streams of the OpenAI API folded into the equivalent non-stream body.

Chat chunks become one `chat.completion` (message content, finish_reason, logprobs, usage);
completion chunks become one `text_completion` (text and logprobs per choice); a Responses
stream becomes the response of its last lifecycle event; an Anthropic Messages stream becomes
one `message` (content blocks, stop_reason, usage). An error event inside the stream becomes
the body's `error`.
"""

from __future__ import annotations

import json

DONE = "[DONE]"


def sse_events(raw: bytes | str) -> list[dict]:
    """The JSON payloads of every `data:` event in `raw` ([DONE] and non-JSON data skipped)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        )
        if not data or data == DONE:
            continue
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            continue
        if isinstance(payload, dict):
            events.append(payload)
    return events


def aggregate(endpoint: str, events: list[dict]) -> dict:
    """The non-stream body equivalent to the stream `events` of `endpoint`."""
    if endpoint.endswith("/chat/completions"):
        return aggregate_chat(events)
    if endpoint.endswith("/responses"):
        return aggregate_responses(events)
    if endpoint.endswith("/messages"):
        return aggregate_messages(events)
    return aggregate_completions(events)


def aggregate_responses(events: list[dict]) -> dict:
    """Responses events -> the response object of the last lifecycle event (completed,
    incomplete or failed carry the whole response)."""
    body: dict = {}
    for e in events:
        if isinstance(e.get("response"), dict):
            body = dict(e["response"])
        elif e.get("type") == "error":
            body["error"] = {k: v for k, v in e.items() if k not in ("type", "sequence_number")}
    return body


def aggregate_messages(events: list[dict]) -> dict:
    """Anthropic Messages events -> one `message` body."""
    body: dict = {}
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for e in events:
        kind = e.get("type")
        if kind == "message_start":
            body = dict(e.get("message") or {})
        elif kind == "content_block_start":
            blocks.append(dict(e.get("content_block") or {}))
        elif kind == "content_block_delta" and blocks:
            delta, block = e.get("delta") or {}, blocks[-1]
            for key in ("text", "thinking"):
                if key in delta:
                    block[key] = block.get(key, "") + delta[key]
            if "partial_json" in delta:
                partial[len(blocks) - 1] = partial.get(len(blocks) - 1, "") + delta["partial_json"]
        elif kind == "message_delta":
            body.update(e.get("delta") or {})
            body["usage"] = {**(body.get("usage") or {}), **(e.get("usage") or {})}
        elif kind == "error":
            body["error"] = e.get("error")
    for i, text in partial.items():
        try:
            blocks[i]["input"] = json.loads(text)
        except json.JSONDecodeError:
            blocks[i]["input"] = text
    body["content"] = blocks
    return body


def _header(events: list[dict], obj: str) -> dict:
    first = next((e for e in events if "id" in e), {})
    return {
        "id": first.get("id"),
        "object": obj,
        "created": first.get("created"),
        "model": first.get("model"),
        "system_fingerprint": first.get("system_fingerprint"),
    }


def _usage_and_error(events: list[dict], body: dict) -> dict:
    for e in events:
        if e.get("usage"):
            body["usage"] = e["usage"]
        if "error" in e:
            body["error"] = e["error"]
    return body


def aggregate_chat(events: list[dict]) -> dict:
    """`chat.completion.chunk` events -> one `chat.completion` body."""
    choices: dict[int, dict] = {}
    for e in events:
        for c in e.get("choices") or []:
            slot = choices.setdefault(
                c.get("index", 0),
                {"content": "", "role": "assistant", "finish": None, "logprobs": None},
            )
            delta = c.get("delta") or {}
            slot["role"] = delta.get("role", slot["role"])
            slot["content"] += delta.get("content") or ""
            if c.get("finish_reason") is not None:
                slot["finish"] = c["finish_reason"]
            lp = c.get("logprobs")
            if lp and lp.get("content"):
                slot["logprobs"] = slot["logprobs"] or {"content": [], "refusal": None}
                slot["logprobs"]["content"].extend(lp["content"])
    body = _header(events, "chat.completion")
    body["choices"] = [
        {
            "index": i,
            "message": {"role": s["role"], "content": s["content"]},
            "finish_reason": s["finish"],
            "logprobs": s["logprobs"],
        }
        for i, s in sorted(choices.items())
    ]
    body["usage"] = None
    return _usage_and_error(events, body)


def aggregate_completions(events: list[dict]) -> dict:
    """`text_completion` chunk events -> one `text_completion` body."""
    choices: dict[int, dict] = {}
    for e in events:
        for c in e.get("choices") or []:
            slot = choices.setdefault(c.get("index", 0), {"text": "", "finish": None, "lp": None})
            slot["text"] += c.get("text") or ""
            if c.get("finish_reason") is not None:
                slot["finish"] = c["finish_reason"]
            lp = c.get("logprobs")
            if lp:
                slot["lp"] = slot["lp"] or {k: [] for k in lp}
                for key, values in lp.items():
                    slot["lp"].setdefault(key, []).extend(values or [])
    body = _header(events, "text_completion")
    body["choices"] = [
        {"index": i, "text": s["text"], "logprobs": s["lp"], "finish_reason": s["finish"]}
        for i, s in sorted(choices.items())
    ]
    body["usage"] = None
    return _usage_and_error(events, body)
