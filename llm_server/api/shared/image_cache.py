"""Decoded images by their file's SHA-256, a bounded LRU: an agent resends every image of a
conversation on each turn, and each file is decoded once while it stays here."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_MAX_BYTES = 256 << 20  # decoded RGB kept: thirty 1080p screenshots, four 8K images


@dataclass(frozen=True)
class Decoded:
    """One file decoded: what every request sending the same bytes gets (never modified)."""

    image: Image.Image  # RGB
    digest: str  # SHA-256 hex of mode, size and pixels (ImageInput.digest)
    format: str  # Pillow's name of the file's format: PNG, JPEG, WEBP, GIF

    @property
    def nbytes(self) -> int:
        return self.image.width * self.image.height * len(self.image.getbands())


class DecodedImages:
    """LRU of Decoded by file hash, at most `max_bytes` of pixels; decoding threads share it."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, Decoded] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Decoded | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: bytes, item: Decoded) -> None:
        if item.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._items[key] = item
            self.bytes += item.nbytes
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._items)
