"""What the dashboard shows, sampled without holding up the engine.

``PoolSnapshot`` is taken on the engine thread between two steps (so its block tables, queues and
counts are one consistent moment), at most every ``interval_s`` while a dashboard is connected, and
only when something changed. It costs O(blocks in use + cached blocks) list copies; everything else
(JSON, the cached-block bitmap) is done later on the server's event loop. ``History`` keeps one
sample a second of the engine's counters for the charts (KV usage, queues, output tok/s, TTFT and ITL
percentiles over a sliding window, prefix-cache hit rate).
"""
from __future__ import annotations

import base64
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pagedllm.engine.core import sample_pool

# One queue entry: (request id, prompt tokens, output tokens, computed tokens, preemptions, block table).
QueueEntry = tuple[str, int, int, int, int, list[int]]


@dataclass(frozen=True)
class PoolSnapshot:
    version: int
    time: float
    num_blocks: int
    running: list[QueueEntry]
    waiting: list[QueueEntry]
    cached_free: list[int]        # block ids holding prefix-cached K/V with reference count 0 (evictable)
    num_running: int              # the scheduler's own counts at the same moment (what /metrics reports)
    num_waiting: int
    kv_cache_usage: float
    num_cached_free_blocks: int   # the pool's own count of cached evictable blocks (not from the list above)

    def to_json(self) -> dict:
        """JSON-ready dict; the evictable blocks as a base64 bitmap (1 bit per block, LSB first)."""
        bits = np.zeros(self.num_blocks, dtype=np.uint8)
        if self.cached_free:
            bits[np.asarray(self.cached_free, dtype=np.int64)] = 1
        return {"version": self.version, "time": self.time, "num_blocks": self.num_blocks,
                "running": [_entry(e) for e in self.running], "waiting": [_entry(e) for e in self.waiting],
                "cached_bitmap": base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode(),
                "stats": {"num_running": self.num_running, "num_waiting": self.num_waiting,
                          "kv_cache_usage": self.kv_cache_usage,
                          "num_cached_free_blocks": self.num_cached_free_blocks}}


def _entry(e: QueueEntry) -> dict:
    rid, prompt, output, computed, preemptions, blocks = e
    return {"id": rid, "prompt_tokens": prompt, "output_tokens": output, "computed_tokens": computed,
            "preemptions": preemptions, "blocks": blocks}


def take_pool_snapshot(engine, version: int) -> PoolSnapshot:
    """Read the scheduler's queues and the block pool of ``engine`` (an LLMEngine). Engine thread only."""
    return PoolSnapshot(version, time.time(), *sample_pool(engine))


class PoolSampler:
    """Takes ``PoolSnapshot``s on the engine thread (``on_step``) while someone watches."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.latest: Optional[PoolSnapshot] = None
        self.watchers = 0
        self._dirty = True
        self._last = 0.0
        self._version = 0
        self._lock = threading.Lock()

    def watch(self, delta: int) -> None:
        with self._lock:
            self.watchers += delta
            if delta > 0:
                self._dirty = True

    def on_step(self, engine, stepped: bool) -> None:
        """Engine thread, after each step (``stepped``) and before idling: snapshot if due."""
        if stepped:
            self._dirty = True
        if not self.watchers or not self._dirty:
            return
        now = time.monotonic()
        if stepped and now - self._last < self.interval_s:
            return  # busy: at most one snapshot per interval; an idle engine is always caught up
        self._version += 1
        self.latest = take_pool_snapshot(engine, self._version)
        self._dirty = False
        self._last = now


    def accept(self, version: int, time_: float, *fields) -> None:
        """A sample taken in an engine core process (``CoreClient.watch_pool``): the fields of a
        ``PoolSnapshot`` after its version and time, in order."""
        self.latest = PoolSnapshot(version, time_, *fields)


class History:
    """One sample a second, ``seconds`` long, of the engine snapshot and recent latencies.

    ``get_snapshot()`` returns the AsyncLLM's EngineSnapshot; ``latencies`` is a deque of
    (monotonic time, "ttft" | "itl", seconds) appended by the metrics on the engine thread."""

    def __init__(self, get_snapshot, latencies: deque, seconds: int = 300, window_s: float = 10.0) -> None:
        self.get_snapshot = get_snapshot
        self.latencies = latencies
        self.window_s = window_s
        self.samples: deque = deque(maxlen=seconds)
        self._prev: Optional[tuple[float, int, int, int]] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "History":
        self._thread = threading.Thread(target=self._run, name="pagedllm-dashboard-history", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def sample(self) -> dict:
        now, mono = time.time(), time.monotonic()
        snap = self.get_snapshot()
        s = snap.stats
        tok_s = hit_rate = 0.0
        if self._prev is not None:
            t0, gen0, q0, h0 = self._prev
            dt = max(mono - t0, 1e-6)
            tok_s = (snap.generation_tokens_total - gen0) / dt
            dq = s.prefix_cache_queries - q0
            hit_rate = min(1.0, (s.prefix_cache_hits - h0) / dq) if dq > 0 else 0.0
        self._prev = (mono, snap.generation_tokens_total, s.prefix_cache_queries, s.prefix_cache_hits)
        recent = [x for x in list(self.latencies) if mono - x[0] <= self.window_s]
        point = {"time": now, "kv_cache_usage": s.kv_cache_usage, "num_running": s.num_running,
                 "num_waiting": s.num_waiting, "output_tokens_per_s": tok_s, "prefix_cache_hit_rate": hit_rate,
                 "ttft": _percentiles([v for _, k, v in recent if k == "ttft"]),
                 "itl": _percentiles([v for _, k, v in recent if k == "itl"])}
        self.samples.append(point)
        return point


def _percentiles(values: list[float]) -> Optional[dict]:
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "count": len(values)}
