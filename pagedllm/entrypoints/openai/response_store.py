"""In-memory store of Responses API responses (``store: true``), bounded by count and by age.

A stored entry keeps the response object (what ``GET /v1/responses/{id}`` returns) and the whole
conversation it ended (chat messages, ``instructions`` excluded) so that ``previous_response_id``
can continue it, as OpenAI's API does. The oldest entries are evicted first once ``max_count`` is
reached; entries older than ``ttl_s`` seconds are gone (404).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from pagedllm.entrypoints.openai.responses_protocol import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict] = field(default_factory=list)   # the conversation including this response's output
    input_items: list[dict] = field(default_factory=list)  # the request's own input, as OpenAI's input items
    events: Optional[list[dict]] = None  # a background response's stream events (replayed on a streamed GET)
    created: float = field(default_factory=lambda: time.monotonic())
    cancel: Optional[Callable[[], None]] = None           # set while the response is still being generated


class ResponseStore:
    """Thread-safe LRU-by-creation store. ``max_count`` >= 1 entries, each kept ``ttl_s`` seconds."""

    def __init__(self, max_count: int = 1024, ttl_s: float = 3600.0) -> None:
        if max_count < 1:
            raise ValueError(f"the response store needs room for at least one response, got {max_count}")
        if ttl_s <= 0:
            raise ValueError(f"the response store's time to live must be positive, got {ttl_s}")
        self.max_count = max_count
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._items:
            key, first = next(iter(self._items.items()))
            if now - first.created <= self.ttl_s:
                break
            del self._items[key]

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            self._expire(time.monotonic())
            self._items[entry.response.id] = entry
            self._items.move_to_end(entry.response.id)
            while len(self._items) > self.max_count:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            self._expire(time.monotonic())
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._items)
