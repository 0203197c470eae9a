"""`--warm-prompts FILE`: the listed prompts, tokenized by the service and prefilled by the engine
while it loads (EngineSettings.warm_tokens), so their first request is a prefix-cache hit.

The file is JSON (a list) or JSONL (one item a line). An item is a prompt string (tokenized as
/v1/completions does), {"prompt": "..."}, or a chat completions body: {"messages": [...]} with
optional "tools" (rendered exactly as /v1/chat/completions renders it for this model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("llm_server")


def load_warm_prompts(path: str | Path) -> list[Any]:
    """The file's items (ValueError naming what is wrong)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: neither JSON nor JSON lines ({exc})") from None
    for i, item in enumerate(items):
        ok = isinstance(item, str) or (
            isinstance(item, dict)
            and (isinstance(item.get("prompt"), str) or isinstance(item.get("messages"), list))
        )
        if not ok:
            raise ValueError(
                f"{path}: item {i} is not a prompt string, {{'prompt': str}} or "
                "{'messages': [...]}"
            )
    return items


def warm_tokens(service, items: list[Any]) -> list[list[int]]:
    """Each item's prompt ids as the API would build them for `service`'s model."""
    from llm_server.api.chat.plan import chat_prompt
    from llm_server.api.shared.errors import APIError
    from llm_server.api.shared.images import is_image_part
    from llm_server.api.shared.schemas import parse_chat

    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "messages" in item:
            try:
                chat = parse_chat({**item, "max_tokens": 1}, 1)
                parts = [
                    p for m in chat.messages if isinstance(m["content"], list) for p in m["content"]
                ]
                if any(is_image_part(p) for p in parts):
                    raise ValueError(f"warm prompt {i}: images are not prefilled; leave them out")
                out.append(chat_prompt(service, chat))
            except APIError as exc:
                raise ValueError(f"warm prompt {i}: {exc}") from None
        else:
            text = item if isinstance(item, str) else item["prompt"]
            out.append(service.tokenizer.encode(text))
    return out
