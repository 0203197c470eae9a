"""Stored responses for `previous_response_id` and GET/DELETE /v1/responses/{id}: a bounded LRU.

Bounded by entries and by bytes (the JSON size of what is kept); the least recently used
response goes first. Lives on the event loop (handlers only), so it needs no lock.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llm_server.api.shared.images import ImageRef

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the conversation that continues from it."""

    response: dict[str, Any]  # the response object as returned
    messages: tuple[dict[str, Any], ...]  # chat messages through this response's output
    size: int  # bytes counted against the store's bound


class ResponseStore:
    """LRU of StoredResponse by id, at most `max_entries` and `max_bytes` (JSON bytes)."""

    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one entry and byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: tuple[dict[str, Any], ...]) -> bool:
        """Keep `response` (evicting the oldest as needed); False when it alone is too big."""
        kept = json.dumps([response, messages], ensure_ascii=False, default=_as_json)
        size = len(kept.encode("utf-8"))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._items[response["id"]] = StoredResponse(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        """The stored response `rid` (now the most recently used), or None."""
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self.bytes -= item.size
        return True


def _as_json(value: Any) -> Any:
    """An image part's ImageRef as its fields (its base64 or URL counts against the bound)."""
    if isinstance(value, ImageRef):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not kept in the response store")
