"""KV-cache manager: each request's block table, slot allocation, prefix-cache lookups, freeing.

Where are blocks freed? ``KVCacheManager.free`` - called by the scheduler when a request
finishes, is aborted or is preempted. With a sliding window on every layer (Mistral 7B v0.1,
StarCoder2, Phi-3-mini), also ``allocate_slots``: blocks whose every token has left the window
of the queries still to come go back to the pool during the request, their table entries pointing
to the null block (vLLM v1's ``SlidingWindowManager``), so a sequence holds about
window + chunk tokens of K/V however long it grows.
"""
from __future__ import annotations

from pagedllm.engine.block_pool import (ROOT_HASH, BlockPool, KVCacheBlock, hash_block_extra, hash_block_tokens,
                                        lora_root_hash)
from pagedllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_per_seq(max_model_len: int, block_size: int, sliding_window: int | None = None,
                       max_num_batched_tokens: int | None = None) -> int:
    """The most blocks one sequence holds at once: all of ``max_model_len``; with a sliding window
    W on every layer, the W - 1 tokens a step's first query sees before it plus the step's at most
    ``max_num_batched_tokens`` new ones, over at most one more block than they fill (the range need
    not start at a block boundary); vLLM sizes sliding-window layers the same way."""
    whole = cdiv(max_model_len, block_size)
    if sliding_window is None:
        return whole
    return min(whole, cdiv(sliding_window - 1 + max_num_batched_tokens, block_size) + 1)


class KVCacheManager:
    """Maps requests to physical blocks of one ``BlockPool``.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: automatic prefix caching (reuse full blocks with equal hashed prefixes).
        sliding_window: W when every layer attends only to its last W positions (j > p - W):
            blocks behind the window are freed as a request advances (None: never).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block=sliding_window is not None)
        self.null_block = self.block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already hashed + cached
        # get_block_ids' answers, kept until the request's blocks change (the input batch reads every
        # running request's table every step; most steps change none of them).
        self._block_ids: dict[str, list[int]] = {}
        # Requests whose block tables changed since take_table_changes -> first entry changed.
        self.table_changes: dict[Request, int] = {}
        # Copy-on-write copies (src block id, dst block id) the runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []
        # Prefix-cache statistics in tokens, counted by the scheduler on admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request: logical block i -> physical block id (the null block's id
        where a sliding window left block i behind). The list is shared until the table changes
        (a new list then): do not modify it."""
        ids = self._block_ids.get(request_id)
        if ids is None:
            blocks = self.req_to_blocks.get(request_id)
            if blocks is None:
                return []
            ids = self._block_ids[request_id] = [b.block_id for b in blocks]
        return ids

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        parent = hashes[-1] if hashes else (ROOT_HASH if request.lora_request is None
                                            else lora_root_hash(request.lora_request.lora_int_id))
        toks = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, toks[i * bs:(i + 1) * bs])
            if request.mm_features:  # the images whose tokens the block holds (Request.mm_block_key)
                key = request.mm_block_key(i * bs, (i + 1) * bs)
                if key:
                    parent = hash_block_extra(parent, key)
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a new request: (blocks, number of tokens they hold).

        At least one token is always left to compute, since the last position's logits are
        needed to sample. With a sliding window only the blocks the next query sees must be
        cached: the longest prefix whose last ceil((W - 1) / block_size) blocks are, the blocks
        before them given as the null block (the chained hashes vouch for the tokens before;
        vLLM's sliding-window manager searches from the right the same way).
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._longest_window_hit(request.block_hashes[:max_blocks])
        blocks = []
        for h in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _longest_window_hit(self, hashes: list[bytes]) -> tuple[list[KVCacheBlock], int]:
        """(blocks, tokens) of the largest k whose blocks k - need .. k - 1 are all cached."""
        # blocks a query at k * block_size sees before it (at least one: a hit holds some K/V)
        need = max(1, cdiv(self.sliding_window - 1, self.block_size))
        cached = [self.block_pool.get_cached_block(h) for h in hashes]
        run = 0  # cached blocks in a row ending at block k - 1
        runs = []
        for block in cached:
            run = run + 1 if block is not None else 0
            runs.append(run)
        for k in range(len(cached), 0, -1):
            if runs[k - 1] >= min(need, k):
                lo = max(0, k - need)
                return [self.null_block] * lo + cached[lo:k], k * self.block_size
        return [], 0

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its computed ones
        and after ``new_computed_blocks``, a prefix-cache hit taken on first scheduling).

        Returns False, changing nothing, when the pool has too few free blocks. A table that changes
        is reported to ``take_table_changes`` (from its first changed entry). Only blocks the new
        tokens fill are hashed and cached. The common decode (the token fits the blocks held, the
        block written not shared) changes no table and allocates nothing: a few comparisons.
        """
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
        hits = new_computed_blocks or ()
        num_computed = request.num_computed_tokens
        if hits:
            num_computed += len(hits) * bs
        first_changed = len(blocks)
        if self.sliding_window is not None:
            hits, dropped = self._drop_behind_window(blocks, list(hits), num_computed)
            if dropped:  # entries behind the window are null now
                self._table_changed(request, 0)
        end = num_computed + num_new_tokens
        num_new_blocks = -(-end // bs) - first_changed - len(hits)
        # Copy-on-write: the next token goes into a partly filled block shared with a sibling.
        write_idx = num_computed // bs
        cow = (num_new_tokens > 0 and num_computed % bs != 0 and not hits and write_idx < first_changed
               and blocks[write_idx].ref_cnt > 1)
        if num_new_blocks > 0 or hits or cow or not blocks:
            # Cache hits that sit in the free queue are taken out of it, so they count too.
            num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
            if num_new_blocks + num_evictable_hits + cow > self.block_pool.get_num_free_blocks():
                if not blocks:
                    del self.req_to_blocks[rid]
                return False
            if cow:
                shared = blocks[write_idx]
                blocks[write_idx] = self.block_pool.get_new_blocks(1)[0]
                self.pending_copies.append((shared.block_id, blocks[write_idx].block_id))
                self.block_pool.free_blocks([shared])
                first_changed = min(first_changed, write_idx)
            if hits:  # (a decode's new block has none: no generator, no call)
                self.block_pool.touch(b for b in hits if b is not self.null_block)
                blocks.extend(hits)
            if num_new_blocks > 0:
                blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
            self._table_changed(request, first_changed)
        num_cached = self.num_cached_blocks.get(rid, 0)
        if self.enable_caching and end // bs > num_cached:
            self._cache_full_blocks(request, blocks, end)
            num_cached = self.num_cached_blocks[rid]
        self._set_free_end(request, blocks, end, num_cached)
        return True

    def _set_free_end(self, request: Request, blocks: list[KVCacheBlock], end: int, num_cached: int) -> None:
        """``request.kv_free_end`` after an allocation for its first ``end`` tokens (``blocks`` its table,
        ``num_cached`` of them cached): the tokens the next calls may add with nothing to do (see
        Request.kv_free_end), up to the end of the blocks held and, with caching, short of filling the
        next block (it is then hashed); none while the block written next is shared (copy-on-write) or
        under a sliding window."""
        bs = self.block_size
        if self.sliding_window is None and not (end % bs and blocks[end // bs].ref_cnt > 1):
            limit = len(blocks) * bs
            request.kv_free_end = min(limit, (num_cached + 1) * bs - 1) if self.enable_caching else limit
        else:
            request.kv_free_end = 0

    def allocate_decode_slots(self, requests: list[Request]) -> int:
        """``allocate_slots(r, 1)`` for each of ``requests`` in order (decodes that hold blocks and take no
        prefix hit), stopping at the first that cannot get its block. Returns how many succeeded.

        The same changes as those calls (the tests compare the whole pool after every step), with the two
        cases a decode meets once a block each inlined: its token needs a new block, or fills the last
        one (hashed and cached). A shared block to copy, images, or a sliding window: ``allocate_slots``.
        """
        if self.sliding_window is not None:
            for k, r in enumerate(requests):
                if not self.allocate_slots(r, 1):
                    return k
            return len(requests)
        bs = self.block_size
        caching = self.enable_caching
        pool = self.block_pool
        free_queue = pool.free_block_queue
        req_to_blocks, num_cached_blocks = self.req_to_blocks, self.num_cached_blocks
        for k, r in enumerate(requests):
            rid = r.request_id
            blocks = req_to_blocks.get(rid)
            computed = r.num_computed_tokens
            held = len(blocks) if blocks else 0
            if (not held or r.mm_features
                    or (computed % bs and computed // bs < held and blocks[computed // bs].ref_cnt > 1)):
                if not self.allocate_slots(r, 1):  # (no blocks yet, images, or copy-on-write)
                    return k
                continue
            end = computed + 1
            if end > held * bs:  # one new block (end is one past a full table)
                if not free_queue:
                    return k
                blocks.append(pool.get_new_blocks(1)[0])
                self._table_changed(r, held)
            num_cached = num_cached_blocks.get(rid, 0)
            if caching and end // bs > num_cached:
                i = end // bs - 1
                hashes = r.block_hashes
                if end % bs == 0 and num_cached == i == len(hashes) > 0:  # fills block i, the ones before hashed
                    hashes.append(hash_block_tokens(hashes[-1], r.all_token_ids[i * bs:end]))
                    pool.cache_block(blocks[i], hashes[i])
                    num_cached = num_cached_blocks[rid] = i + 1
                else:
                    self._cache_full_blocks(r, blocks, end)
                    num_cached = num_cached_blocks[rid]
            self._set_free_end(r, blocks, end, num_cached)
        return len(requests)

    def _table_changed(self, request: Request, first: int) -> None:
        """``request``'s block table changed from entry ``first`` on."""
        self._block_ids.pop(request.request_id, None)
        changes = self.table_changes
        old = changes.get(request)
        changes[request] = first if old is None or first < old else old

    def take_table_changes(self) -> dict[Request, int]:
        """The requests whose block tables changed since the last call -> the first entry that changed
        (what a persistent batch must rewrite; ``engine/input_batch.py``)."""
        changes, self.table_changes = self.table_changes, {}
        return changes

    def _drop_behind_window(self, blocks: list[KVCacheBlock], hits: list[KVCacheBlock],
                            num_computed: int) -> tuple[list[KVCacheBlock], bool]:
        """Free the leading blocks of ``blocks`` that no query from position ``num_computed`` on
        can see (each of their positions is < num_computed - W + 1), pointing their entries to the
        null block; prefix-cache ``hits`` that far back are not taken (null entries instead).
        Returns the hits with those replaced, and whether ``blocks`` changed."""
        num_behind = max(0, num_computed - self.sliding_window + 1) // self.block_size
        behind = [b for b in blocks[:num_behind] if b is not self.null_block]
        if behind:
            blocks[:num_behind] = [self.null_block] * min(num_behind, len(blocks))
            self.block_pool.free_blocks(behind)
        skip = min(max(0, num_behind - len(blocks)), len(hits))
        return ([self.null_block] * skip + hits[skip:] if skip else hits), bool(behind)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            if blocks[i] is not self.null_block:  # (a hit left behind the window: not ours to cache)
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the same blocks as ``parent`` (one more reference each): parallel
        sampling shares the prompt's K/V; a shared block is copied before it is written."""
        blocks = list(self.req_to_blocks.get(parent.request_id, ()))
        for b in blocks:
            if b is not self.null_block:
                b.ref_cnt += 1
        self.req_to_blocks[child.request_id] = blocks
        parent.kv_free_end = child.kv_free_end = 0  # their block written next is shared now
        self._table_changed(child, 0)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def trim(self, request: Request, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` blocks of ``request`` (speculative decoding: blocks past
        them held only rejected proposals). They were never hashed: the prefix cache hashes only full
        blocks of ``all_token_ids``."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or len(blocks) <= num_blocks:
            return
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        request.kv_free_end = 0
        self._block_ids.pop(request.request_id, None)
        self._table_changed(request, num_blocks)
        self.block_pool.free_blocks(b for b in reversed(tail) if b is not self.null_block)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool (cached ones stay reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        request.kv_free_end = 0
        self.num_cached_blocks.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self.table_changes.pop(request, None)
        if blocks:
            null = self.null_block
            self.block_pool.free_blocks(reversed(blocks) if null is None else
                                        (b for b in reversed(blocks) if b is not null))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
