"""The block pool: every KV-cache block of the engine, their reference counts, the free queue,
and the prefix-cache index (block hash -> block).

A block is free when its reference count is 0. Free blocks that still hold a full, hashed block
stay in the prefix-cache index until they are handed out again, so the free queue doubles as the
LRU eviction order (Kwon et al., SOSP 2023, section 4; vLLM v1 ``block_pool.py``).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Iterable, Optional

# Hash of the (empty) parent of a request's first block.
ROOT_HASH = b"pagedllm-root"


def hash_block_tokens(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained, collision-resistant hash of one full block: sha256(parent hash || token ids).

    Two blocks share a hash only if their whole prefixes are equal (up to sha256 collisions),
    so a cache hit never serves K/V of other tokens. The ids are packed as native int64
    (``array("q")``'s bytes) by a ``struct.Struct`` kept per block length (packing was half the cost).
    """
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    packer = _PACKERS.get(len(ids))
    if packer is None:
        packer = _PACKERS[len(ids)] = struct.Struct(f"{len(ids)}q")
    return hashlib.sha256(parent_hash + packer.pack(*ids)).digest()


_PACKERS: dict[int, struct.Struct] = {}  # ids per block -> its int64 packer (hash_block_tokens)


def hash_block_extra(block_hash: bytes, extra: bytes) -> bytes:
    """A block's hash with more keys than its tokens mixed in (the identifiers of the images whose
    placeholder tokens it holds; vLLM's ``extra_keys``): sha256(hash || 0xff || extra)."""
    return hashlib.sha256(block_hash + b"\xff" + extra).digest()


def lora_root_hash(lora_int_id: int) -> bytes:
    """The chain's root for a request run with LoRA adapter ``lora_int_id``: its blocks' K/V differ from
    the base model's (and another adapter's) for the same tokens, so their hashes must too (vLLM
    puts the adapter in the block hash's extra keys). -1 is no token id."""
    return hash_block_tokens(ROOT_HASH, (-1, lora_int_id))


class KVCacheBlock:
    """Metadata of one physical block (its K/V live in the model runner's cache tensors)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns ``num_blocks`` blocks.

    With ``reserve_null_block`` block 0 is taken out of the pool for good (``null_block``): it
    fills block-table entries whose K/V were freed (tokens behind a sliding window), as vLLM's
    null block. Attention never reads it unmasked; it is never freed, cached or handed out.

    Raises:
        ValueError: ``num_blocks`` < 1.
        RuntimeError: asked for more new blocks than are free (callers check first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # LRU order: the first entry is evicted/handed out first.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # Free blocks that still hold prefix-cached K/V (evictable), kept as a count so that
        # metrics and the dashboard read it in O(1).
        self.num_cached_free_blocks = 0
        self.null_block: Optional[KVCacheBlock] = None
        if reserve_null_block:
            _, self.null_block = self.free_block_queue.popitem(last=False)
            self.null_block.ref_cnt = 1
        # Blocks that can ever be handed out (all but the null block).
        self.num_usable_blocks = num_blocks - reserve_null_block

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, possibly holding evictable cached K/V)."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of the usable blocks held by requests (0.0 - 1.0)."""
        return 1.0 - len(self.free_block_queue) / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting their cache entry)."""
        queue = self.free_block_queue
        if num_blocks > len(queue):
            raise RuntimeError(f"cannot get {num_blocks} free blocks, only {len(queue)} left")
        out = []
        for _ in range(num_blocks):
            _, block = queue.popitem(last=False)
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. A block reaching 0 that holds prefix-cached K/V joins
        the tail of the free queue (evicted last, in LRU order); one without goes to the head,
        to be handed out first.

        Handing out uncached blocks first keeps cached K/V longer, and keeps the pool's working
        set at the peak number of blocks in use: blocks never used are never touched, so their
        memory pages are neither faulted in nor resident (a CPU cache that is not zero-filled
        costs memory only where K/V were written).

        Pass a request's blocks in reverse order so that its last (least shareable) blocks are
        evicted first.
        """
        queue = self.free_block_queue
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt = ref_cnt - 1
            if ref_cnt == 1:
                queue[block.block_id] = block
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                else:
                    queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that ``block`` holds the full block ``block_hash``. First writer wins: a second
        block with the same tokens is not marked cached (a lookup would never find it)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
        self.num_cached_free_blocks = 0
