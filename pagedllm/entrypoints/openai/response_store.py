"""In-memory store of Responses API responses (``store: true``), bounded by count, size and age.

A stored entry keeps the response object (what ``GET /v1/responses/{id}`` returns) and the whole
conversation it ended (chat messages, ``instructions`` excluded) so that ``previous_response_id``
can continue it, as OpenAI's API does. The oldest entries are evicted first once ``max_count`` is
reached or their sizes (the response object, input items, conversation and events as JSON) pass
``max_bytes``: a request's input may carry megabytes that are never rendered (a reasoning item's
``encrypted_content``, a schema's descriptions), and a chained conversation is kept whole by each of
its responses. Entries older than ``ttl_s`` seconds
are gone (404).
"""
from __future__ import annotations

import json
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
    nbytes: int = 0  # its JSON's size when last measured (ResponseStore._size)


class ResponseStore:
    """Thread-safe LRU-by-creation store. ``max_count`` >= 1 entries, each kept ``ttl_s`` seconds,
    about ``max_bytes`` in all (the newest entry stays even when it alone is larger)."""

    def __init__(self, max_count: int = 1024, ttl_s: float = 3600.0, max_bytes: int = 256 * 2 ** 20) -> None:
        if max_count < 1:
            raise ValueError(f"the response store needs room for at least one response, got {max_count}")
        if ttl_s <= 0:
            raise ValueError(f"the response store's time to live must be positive, got {ttl_s}")
        if max_bytes < 1:
            raise ValueError(f"the response store needs at least one byte, got {max_bytes}")
        self.max_count = max_count
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.nbytes = 0  # the entries' nbytes summed
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def _pop_oldest(self) -> None:
        _, entry = self._items.popitem(last=False)
        self.nbytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.created <= self.ttl_s:
                break
            self._pop_oldest()

    def _evict(self) -> None:
        while len(self._items) > self.max_count or (self.nbytes > self.max_bytes and len(self._items) > 1):
            self._pop_oldest()

    @staticmethod
    def _size(entry: StoredResponse) -> int:
        """Characters of its JSON: the response object (its schema, tools, instructions, metadata and
        output), the input items, the conversation and a background response's events."""
        return (len(entry.response.model_dump_json()) + len(json.dumps(entry.input_items, default=str))
                + len(json.dumps(entry.messages, default=str)) + len(json.dumps(entry.events or [], default=str)))

    def put(self, entry: StoredResponse) -> None:
        size = self._size(entry)  # outside the lock: a large input takes a while
        with self._lock:
            self._expire(time.monotonic())
            old = self._items.pop(entry.response.id, None)
            if old is not None:
                self.nbytes -= old.nbytes
            entry.nbytes = size
            self.nbytes += size
            self._items[entry.response.id] = entry
            self._evict()

    def measure(self, entry: StoredResponse) -> None:
        """Account for what the entry holds now (its conversation grows by the output when the
        response ends), evicting the oldest entries if the store is now over ``max_bytes``."""
        size = self._size(entry)
        with self._lock:
            if self._items.get(entry.response.id) is not entry:
                return  # evicted or deleted meanwhile
            self.nbytes += size - entry.nbytes
            entry.nbytes = size
            self._evict()

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            self._expire(time.monotonic())
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._items.pop(response_id, None)
            if entry is not None:
                self.nbytes -= entry.nbytes
            return entry is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._items)
