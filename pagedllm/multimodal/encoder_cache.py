"""The encoder cache: each image's embedding rows, kept by the model runner under the image's content
hash so that an image seen again (a multi-turn chat resending it, a prompt whose prefix-cache hit
ends inside an image, an image shared by requests) is not encoded again (vLLM's EncoderCacheManager).

The engine side (``EncoderCacheManager``, next to the scheduler) decides, and the runner obeys: each
step's ``MultiModalStep`` says which images to encode (their tensors travel), which cached entries
to drop, and where each needed image's rows go in the step's flat batch. The manager keeps the
runner's contents exactly (an LRU of identifiers, bounded in embedding rows), so it knows a hit
without asking, and its counters are the /metrics ones (``vllm:mm_cache_queries``/``hits`` in vLLM's
naming; ours ``pagedllm:encoder_cache_queries``/``hits``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.multimodal.inputs import MultiModalFeature


@dataclass
class MultiModalStep:
    """What the runner does with images in one step (picklable, for worker processes).

    encode: (identifier, the image's tensors) to run the tower on and keep.
    evict: identifiers to drop first.
    scatter: (identifier, first row in the step's flat batch, first embedding row, rows): copy
        embedding rows [src, src + n) of that image into the inputs' embeddings at [dst, dst + n).
    """
    encode: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    scatter: list[tuple[str, int, int, int]] = field(default_factory=list)


class EncoderCacheManager:
    """The engine's view of the runner's encoder cache: an LRU of (identifier -> embedding rows) holding
    at most ``capacity`` rows (an image larger than that is still encoded, and kept until the next
    image needs the room). ``capacity`` 0: off (each step encodes the images it needs, none is reused)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.queries = 0  # images needed by a step
        self.hits = 0  # ... of which the runner already held the embeddings

    def plan(self, needed: list[MultiModalFeature]) -> MultiModalStep:
        """The step's encode/evict lists for the images ``needed`` (scatter is the caller's)."""
        step = MultiModalStep()
        if self.capacity <= 0:  # the cache off: what an earlier step encoded is dropped, never reused
            step.evict = self.reset()
        now = {f.identifier for f in needed}
        for f in needed:
            if f.identifier in self.entries:
                self.entries.move_to_end(f.identifier)
                if not any(e[0] == f.identifier for e in step.encode):
                    self.queries += 1
                    self.hits += 1
                continue
            self.queries += 1
            size = f.num_embeds
            while self.entries and self.used + size > self.capacity:
                old = next((k for k in self.entries if k not in now), None)
                if old is None:
                    break
                self.used -= self.entries.pop(old)
                step.evict.append(old)
            self.entries[f.identifier] = size
            self.used += size
            step.encode.append((f.identifier, f.tensors()))
        return step

    def reset(self) -> list[str]:
        """Forget everything (returns the identifiers the runner must drop)."""
        gone = list(self.entries)
        self.entries.clear()
        self.used = 0
        return gone


class EncoderCache:
    """The runner's side: identifier -> embedding rows [n, hidden] on the model's device."""

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def apply(self, step: MultiModalStep, tower, device: str) -> None:
        """Drop ``step.evict``, encode ``step.encode`` with ``tower`` (one batch per equal-shaped group)."""
        for ident in step.evict:
            self.store.pop(ident, None)
        if not step.encode:
            return
        groups: dict[tuple, list[tuple[str, dict[str, torch.Tensor]]]] = {}
        for ident, data in step.encode:
            key = tuple((k, tuple(v.shape)) for k, v in sorted(data.items()))
            groups.setdefault(key, []).append((ident, data))
        for group in groups.values():
            outs = tower.encode([{k: v.to(device) for k, v in data.items()} for _, data in group])
            for (ident, _), emb in zip(group, outs):
                self.store[ident] = emb

    def embeddings(self, ident: str) -> Optional[torch.Tensor]:
        return self.store.get(ident)


# Embedding rows the encoder cache holds at least (a 256-token image: 16 of them).
MIN_ENCODER_CACHE_ROWS = 4096


def encoder_cache_capacity(config) -> int:
    """Rows of the runner's encoder cache: one step's worth of tokens, at least MIN_ENCODER_CACHE_ROWS
    (vLLM sizes its cache from the same budget)."""
    return max(config.scheduler_config.max_num_batched_tokens, MIN_ENCODER_CACHE_ROWS)
