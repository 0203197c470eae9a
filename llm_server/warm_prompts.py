"""`--warm-prompts FILE` and `--prefix-cache-dir`: the prefix cache's disk tier attached and the
listed prompts prefilled while the model loads, so their first request is a prefix-cache hit.

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
    from llm_server.api.shared.schemas import parse_chat

    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "messages" in item:
            try:
                chat = parse_chat({**item, "max_tokens": 1}, 1)
                out.append(chat_prompt(service, chat))
            except APIError as exc:
                raise ValueError(f"warm prompt {i}: {exc}") from None
        else:
            text = item if isinstance(item, str) else item["prompt"]
            out.append(service.tokenizer.encode(text))
    return out


def prepare_engine(engine, cache_dir: Path | None, disk_bytes: int | None, prompts) -> None:
    """Attach the disk tier (when `cache_dir` is set) and read its most recent conversations
    back into the rows (`resume`), then prefill each of `prompts` (token lists) on a free row
    and release it: its KV stays in the row, and goes to the prefix cache when the row is
    needed or the store given back (mlx_rows). Runs on the scheduler thread before the model
    reports ready."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is None or not cache.enabled:
        if cache_dir is not None or prompts:
            log.warning("prefix cache off for this model: --prefix-cache-dir/--warm-prompts unused")
        return
    if cache_dir is not None:
        from llm_server.engines.kv.prefix_disk import (
            DiskTier,
            default_disk_bytes,
            engine_fingerprint,
        )

        cache_dir = Path(cache_dir)
        bound = default_disk_bytes(cache_dir) if disk_bytes is None else disk_bytes
        cache.attach_disk(DiskTier(cache_dir, bound, engine_fingerprint(engine), cache.min_tokens))
        resumed = engine.resume() if hasattr(engine, "resume") else 0
        if resumed:
            log.info("resumed %d conversation(s) from %s into the KV store", resumed, cache_dir)
    for ids in prompts:
        ids = ids[: engine.context_length]
        if len(ids) >= cache.min_tokens:
            pick = getattr(engine, "preferred_row", None)  # not over a resumed conversation
            row = 0 if pick is None else pick(ids, list(range(engine.rows)))
            engine.prefill(row, ids)
            engine.release(row)
    if prompts:
        log.info("prefilled %d warm prompts into the prefix cache", len(prompts))
