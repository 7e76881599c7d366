"""A bounded in-memory LRU of small objects' bytes (pure: the app fills and reads it)."""

from __future__ import annotations

from collections import OrderedDict


class ByteCache:
    """LRU of small objects' bytes by sha256. Content-addressed, so an entry can never be stale."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, sha256: str) -> bytes | None:
        item = self._items.get(sha256)
        if item is not None:
            self._items.move_to_end(sha256)
        return item

    def put(self, sha256: str, data: bytes) -> None:
        if len(data) > self.max_bytes // 4 or sha256 in self._items:
            return  # one huge blob must not flush everything else
        self._items[sha256] = data
        self._bytes += len(data)
        while self._bytes > self.max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self._bytes -= len(old)

    def discard(self, sha256: str) -> None:
        old = self._items.pop(sha256, None)
        if old is not None:
            self._bytes -= len(old)
