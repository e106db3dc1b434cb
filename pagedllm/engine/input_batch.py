"""The step's flat batch, kept from step to step (vLLM V1's persistent ``InputBatch``): input_ids,
positions, slot_mapping, the attention metadata (block tables, sequence lengths, query offsets; built
once per step and shared by every layer), and which rows of the output need logits.

Batch order: one-token sequences (decodes) first, in the scheduler's order, then multi-token chunks
(prefills). The decode rows live in preallocated NumPy arrays (next input token, position, block-table
row and its length), one row a sequence. A step updates only what changed:

- a sequence that decoded and sampled last step (a *steady* row) advances in place: its position + 1,
  its input token the one sampled (``record_sampled``, one array write for the whole batch);
- a row whose block table changed gets the changed tail of its table (the KV manager reports each
  change: ``KVCacheManager.take_table_changes``); an appended block writes one entry;
- sequences that join, leave or move are one gather of the arrays (rows compacted in order); only a
  joining row (or one that did not sample last step: a one-token prompt chunk, a fork leader) is read
  from its ``Request``.

So a decode step whose sequences all stay is a few array operations and one list comparison, however
large the batch; the per-sequence Python is O(changed sequences). The tensors handed to the model are
fresh copies (a batch in flight never sees the next step's writes). Prefill chunks are built from
their requests as before (their cost is in proportion to their tokens anyway).

M-RoPE (Qwen2-VL's image positions, ``layers/mrope.py``): a request whose prompt holds images carries its
prompt's positions [3, L] and a ``delta``. The model sees a decode row at position + delta (the three
streams agree past the prompt: plain RoPE, shifted), so a decode-only step keeps [N] positions; a step
with a prefill chunk of such a prompt gets [3, N] positions (each stream a row). The slots, sequence
lengths and block tables always follow the token's index.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.layers.mrope import mrope_positions_at
from pagedllm.lora.slots import LoRASlotTable
from pagedllm.multimodal.encoder_cache import EncoderCacheManager, MultiModalStep
from pagedllm.worker.model_input import ModelInput


@dataclass
class StepPlan:
    """Driver-side bookkeeping that maps logits rows back to requests."""

    model_input: ModelInput
    sampling_requests: list[Request]
    # (request, first prompt position whose logprob is computed, number of positions)
    prompt_logprob_spans: list[tuple[Request, int, int]] = field(default_factory=list)
    # which InputBatch.prepare call made it (record_sampled applies only to the latest)
    generation: int = -1
    # (request, new tokens) of every sequence of the step but the rows that advanced in place (those
    # decoded and sampled last step): prefill chunks, joining rows, rows read from their requests
    fresh: list[tuple[Request, int]] = field(default_factory=list)


# Rows from which InputBatch writes its arrays with one NumPy call for all (below, row by row is faster).
_MANY_ROWS = 8


def _t(a: np.ndarray, device: str) -> torch.Tensor:
    """A tensor over ``a`` (a fresh array, not a view of the persistent ones) on ``device``."""
    t = torch.from_numpy(a)
    return t if device == "cpu" else t.to(device)


def image_step(cache: EncoderCacheManager, rows: list[tuple[Request, int, int]]) -> Optional[MultiModalStep]:
    """The step's MultiModalStep for ``rows`` (request, tokens scheduled from its computed count, first
    row of them in the flat batch), None when none of those tokens is an image's: where each image
    token's embedding row goes, and the encoder cache's plan (encode / evict)."""
    needed: list = []
    scatter: list[tuple[str, int, int, int]] = []
    for r, k, row in rows:
        start = r.num_computed_tokens
        if not r.mm_features or start >= r.num_prompt_tokens:
            continue
        end = start + k
        for f in r.mm_features:
            lo, hi = max(f.offset, start), min(f.offset + f.length, end)
            if lo >= hi:
                continue
            if f.is_embed is None:
                scatter.append((f.identifier, row + lo - start, lo - f.offset, hi - lo))
            else:  # only the span tokens marked is_embed take rows, in order
                src = sum(f.is_embed[:lo - f.offset])
                p = lo
                while p < hi:
                    if not f.is_embed[p - f.offset]:
                        p += 1
                        continue
                    q = p
                    while q < hi and f.is_embed[q - f.offset]:
                        q += 1
                    scatter.append((f.identifier, row + p - start, src, q - p))
                    src += q - p
                    p = q
            if all(g.identifier != f.identifier for g in needed):
                needed.append(f)
    if not needed:
        return None
    step = cache.plan(needed)
    step.scatter = scatter
    return step


def image_spans(r: Request, seq: PrefillSeq) -> tuple[tuple[int, int], ...]:
    """The placeholder spans [lo, hi) of ``r``'s images that prefill chunk ``seq`` computes tokens of
    (``PrefillSeq.bidirectional`` for a model whose image tokens attend both ways)."""
    first = seq.seq_len - (seq.query_end - seq.query_start)
    return tuple((f.offset, f.offset + f.length) for f in r.mm_features
                 if f.offset < seq.seq_len and first < f.offset + f.length)


def mrope_positions(positions: np.ndarray, decodes: list[Request], prefills: list[tuple[Request, int]],
                    n: int) -> np.ndarray:
    """``positions`` [N] as they are, unless a request of the step carries M-RoPE positions (Qwen2-VL's
    images: ``Request.mrope_positions`` [3, L]): then [3, N] int64, where a prompt token at p takes its
    request's column p, a later token p + ``mrope_position_delta`` on every row, and a request without
    them p on every row (text only: the three streams agree). For a batch whose positions are the tokens'
    indexes (the speculator's verification batch); ``InputBatch.prepare`` builds its own (decode rows
    stay [N], at index + delta)."""
    if not any(r.mrope_positions is not None for r in decodes) and \
            not any(r.mrope_positions is not None for r, _ in prefills):
        return positions
    out = np.broadcast_to(positions, (3, len(positions))).copy()

    def fill(r: Request, row: int, k: int) -> None:
        if r.mrope_positions is not None:  # (a request's tokens of a step are consecutive)
            start = int(positions[row])
            out[:, row:row + k] = mrope_positions_at(r.mrope_positions, r.mrope_position_delta, start,
                                                     start + k).numpy()

    for i, r in enumerate(decodes):
        fill(r, i, 1)
    row = n
    for r, k in prefills:
        fill(r, row, k)
        row += k
    return out


class InputBatch:
    """The decode rows of the running sequences, kept across steps, and the step's batch built from them.

    Args:
        kv: the KV cache manager whose block tables the rows mirror.
        max_num_seqs: rows preallocated (grown if a step has more one-token sequences).
        max_model_len: sets the block-table width, ceil(max_model_len / block_size) (grown if needed).
        device: where the batch tensors go.

    Arrays (row i = the i-th one-token sequence of the last step): ``token`` [R] int64 next input token,
    ``pos`` [R] int64 its position, ``tables`` [R, W] int32 block table (0 past ``num_blocks``),
    ``num_blocks`` [R] int32, ``steady`` [R] bool (the row sampled last step and the arrays are current),
    ``delta`` [R] int64 what the model's position differs from ``pos`` by (M-RoPE's; 0 for most).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_model_len: int, device: str) -> None:
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        rows, width = max(1, max_num_seqs), max(1, cdiv(max_model_len, self.block_size))
        self.token = np.zeros(rows, np.int64)
        self.pos = np.zeros(rows, np.int64)
        self.tables = np.zeros((rows, width), np.int32)
        self.num_blocks = np.zeros(rows, np.int32)
        self.steady = np.zeros(rows, bool)
        self.delta = np.zeros(rows, np.int64)
        self.rows: list[Request] = []  # the requests of the rows, in batch order
        self.row_of: dict[Request, int] = {}
        self.generation = 0
        # after prepare: per row its sampled token's index or -1 (None: row i samples token i), the rows
        self._sample_src: Optional[np.ndarray] = None
        self._num_rows = -1
        self._arange = np.arange(rows, dtype=np.int64)
        # under --enable-lora (set by the engine): the slot table that gives each token of a step its
        # adapter's slot (ModelInput.lora); None: LoRA off
        self.lora_slots: Optional[LoRASlotTable] = None
        # for an image-text model (set by the engine): the runner's encoder cache as the engine sees it;
        # None: no image input
        self.encoder_cache: Optional[EncoderCacheManager] = None
        # the model's image tokens attend bidirectionally within an image (Gemma 3): prefill chunks carry
        # their image spans (PrefillSeq.bidirectional)
        self.mm_bidirectional = False

    # ---- row bookkeeping ---------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget what the rows know: every row is read from its request at the next step (call after
        changing requests' tokens or computed counts other than through a step, e.g. several tokens
        accepted at once)."""
        self.steady[:] = False
        self._num_rows = -1

    def _grow(self, rows: int, width: int) -> None:
        rows = max(rows, len(self.token))
        width = max(width, self.tables.shape[1])
        for name in ("token", "pos", "num_blocks", "steady", "delta"):
            old = getattr(self, name)
            new = np.zeros(rows, old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
        tables = np.zeros((rows, width), np.int32)
        tables[:self.tables.shape[0], :self.tables.shape[1]] = self.tables
        self.tables = tables

    def _write_table(self, i: int, ids: Sequence[int], first: int) -> None:
        """Row i's block table from entry ``first`` on (the entries before are unchanged); every row
        is kept zero past its table."""
        n = len(ids)
        if n > self.tables.shape[1]:
            self._grow(0, n)
        old = int(self.num_blocks[i])
        if n > first:
            self.tables[i, first:n] = ids[first:]
        if old > n:
            self.tables[i, n:old] = 0
        self.num_blocks[i] = n

    def _reorder(self, decodes: list[Request]) -> None:
        """Rows := ``decodes``: the rows of sequences that stay are gathered (in their new order), the
        others marked to be read from their requests."""
        n = len(decodes)
        if n > len(self.token):
            self._grow(n, 0)
        row_of = self.row_of
        src = np.array([row_of.get(r, -1) for r in decodes], np.int64)
        kept = src >= 0
        src[~kept] = 0
        if n:
            used = int(self.num_blocks[:len(self.rows)].max()) if self.rows else 0
            self.token[:n] = self.token[src]
            self.pos[:n] = self.pos[src]
            self.delta[:n] = self.delta[src]
            self.num_blocks[:n] = self.num_blocks[src]  # (a joining row's is rewritten by _refresh)
            self.steady[:n] = self.steady[src] & kept
            if used:
                self.tables[:n, :used] = self.tables[src, :used]
        if n < len(self.rows):  # rows no longer used: zero, so that every row is zero past its table
            self.tables[n:len(self.rows)] = 0
            self.num_blocks[n:len(self.rows)] = 0
        self.steady[n:] = False
        self.rows = decodes  # (a list nobody modifies: prepare's own, or the scheduler's table rows)
        self.row_of = dict(zip(self.rows, range(n)))

    def _refresh(self, i: int, r: Request) -> None:
        """Row i read from its request."""
        start = r.num_computed_tokens
        self.token[i] = r.all_token_ids[start]
        self.pos[i] = start
        self.delta[i] = r.mrope_position_delta
        self._write_table(i, self.kv.get_block_ids(r.request_id), 0)

    def _refresh_rows(self, rows: list[int], decodes: list[Request]) -> None:
        """Rows ``rows`` (ascending) read from their requests (``decodes[i]`` for row i): ``_refresh`` row
        by row for a few, else as one write per array (whole tables scattered at once)."""
        if len(rows) < _MANY_ROWS:
            for i in rows:
                self._refresh(i, decodes[i])
            return
        reqs = [decodes[i] for i in rows]
        idx = np.array(rows, np.int64)
        starts = [r.num_computed_tokens for r in reqs]
        self.token[idx] = [r.all_token_ids[p] for r, p in zip(reqs, starts)]
        self.pos[idx] = starts
        self.delta[idx] = [r.mrope_position_delta for r in reqs]
        get_block_ids = self.kv.get_block_ids
        tables = [get_block_ids(r.request_id) for r in reqs]
        self._scatter_tables(idx, tables)

    def _scatter_tables(self, idx: np.ndarray, tables: list[list[int]]) -> None:
        """Rows ``idx`` [k] int64 (distinct) := the block tables ``tables`` (each zero past its table)."""
        lens = np.fromiter(map(len, tables), np.int64, len(tables))
        total = int(lens.sum())
        if total and int(lens.max()) > self.tables.shape[1]:
            self._grow(0, int(lens.max()))
        old = int(self.num_blocks[idx].max())
        if old:
            self.tables[idx, :old] = 0
        if total:
            ends = np.cumsum(lens)
            cols = np.arange(total, dtype=np.int64) - np.repeat(ends - lens, lens)
            self.tables[np.repeat(idx, lens), cols] = np.fromiter(itertools.chain.from_iterable(tables), np.int32,
                                                                   total)
        self.num_blocks[idx] = lens

    def _apply_table_changes(self, changes: dict[Request, int]) -> None:
        """The block tables that changed (request -> first entry changed; ``take_table_changes``): the
        changed tails of the rows of those requests. Most changes are one block appended (one entry a
        row, written together when there are many); the rest are rewritten from their first change."""
        # (self.tables / self.num_blocks are read at each use: _write_table may grow them, new arrays)
        row_of, req_to_blocks = self.row_of, self.kv.req_to_blocks
        many = len(changes) >= _MANY_ROWS
        app_rows: list[int] = []
        app_first: list[int] = []
        app_ids: list[int] = []
        for req, first in changes.items():
            i = row_of.get(req)
            if i is None:
                continue
            blocks = req_to_blocks.get(req.request_id, ())
            if len(blocks) == first + 1 and first < self.tables.shape[1]:  # one block appended?
                if many:  # (checked against num_blocks below, all at once)
                    app_rows.append(i)
                    app_first.append(first)
                    app_ids.append(blocks[first].block_id)
                    continue
                if self.num_blocks[i] == first:
                    self.tables[i, first] = blocks[first].block_id
                    self.num_blocks[i] = first + 1
                    continue
            self._write_table(i, self.kv.get_block_ids(req.request_id), first)
        if app_rows:
            rows, firsts = np.array(app_rows, np.int64), np.array(app_first, np.int64)
            appended = self.num_blocks[rows] == firsts
            if not appended.all():  # (a row whose table was not as long as its first change)
                for j in np.flatnonzero(~appended).tolist():
                    i = app_rows[j]
                    self._write_table(i, self.kv.get_block_ids(self.rows[i].request_id), app_first[j])
                rows, firsts = rows[appended], firsts[appended]
                app_ids = np.array(app_ids, np.int32)[appended]
            self.tables[rows, firsts] = app_ids
            self.num_blocks[rows] = firsts + 1

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, forks: Optional[dict[str, list[Request]]] = None) -> StepPlan:
        """The batch of ``out`` (the scheduler's plan). ``forks``: leader id -> samples that fork from
        it once its prompt is done; they sample from the leader's logits row in the same step."""
        kv, bs, device = self.kv, self.block_size, self.device
        if out.table_rows is not None and len(out.table_rows) == len(out.scheduled):
            decodes, prefills = out.table_rows, []  # (the scheduler's list: the same while the rows stay)
        else:
            decodes = [r for r, n in out.scheduled if n == 1]
            prefills = [(r, n) for r, n in out.scheduled if n > 1] if len(decodes) < len(out.scheduled) else []
        changes = kv.take_table_changes()
        if decodes is not self.rows:
            if decodes != self.rows:  # (list equality: identity first)
                self._reorder(decodes)
            else:  # the kept list: the same object step after step (the engine keeps its sampling rows)
                decodes = self.rows
        n = len(decodes)
        if n >= len(self._arange):
            self._arange = np.arange(2 * n + 1, dtype=np.int64)
        if changes:
            self._apply_table_changes(changes)
        unsteady = [] if np.count_nonzero(self.steady[:n]) == n else np.flatnonzero(~self.steady[:n]).tolist()
        if unsteady:
            self._refresh_rows(unsteady, decodes)

        # Which rows sample (and which prompt positions get logprobs). A row "samples plainly" when its
        # token is its sequence's last (so it samples), no fork samples from it and it has no prompt
        # position to report; a steady row always does.
        sample_idx: list[int] = []
        sampling_requests: list[Request] = []
        plp_idx: list[int] = []
        plp_spans: list[tuple[Request, int, int]] = []

        def note_outputs(r: Request, start: int, k: int, offset: int) -> None:
            if start + k == r.num_tokens:
                for s in [r, *(forks or {}).get(r.request_id, ())]:
                    sample_idx.append(offset + k - 1)
                    sampling_requests.append(s)
            if r.sampling_params.prompt_logprobs is not None:
                # Logits at position j give the logprob of prompt token j + 1.
                first_ = max(start, len(r.prompt_logprobs) - 1)
                last = min(start + k, r.num_prompt_tokens - 1)
                if last > first_:
                    plp_idx.extend(range(offset + first_ - start, offset + last - start))
                    plp_spans.append((r, first_ + 1, last - first_))

        plain = True
        for i in unsteady:
            r = decodes[i]
            if (r.num_computed_tokens + 1 != r.num_tokens or (forks and r.request_id in forks)
                    or (r.sampling_params.prompt_logprobs is not None
                        and r.num_computed_tokens < r.num_prompt_tokens - 1)):
                plain = False
                break
        if plain:
            sample_src = None  # row i samples token i
            # (the rows' own list when nothing is appended: the engine keeps the sampling rows while
            # the list is the same)
            sampling_requests = decodes if not prefills else list(decodes)
            sample_idx_np = self._arange[:n]
        else:  # the general bookkeeping, row by row
            sample_src = np.full(n, -1, np.int64)
            for i, r in enumerate(decodes):
                before = len(sample_idx)
                note_outputs(r, r.num_computed_tokens, 1, i)
                if len(sample_idx) > before:  # its own token is the first it samples
                    sample_src[i] = before
            sample_idx_np = np.array(sample_idx, np.int64)
            sample_idx = []

        pos = self.pos[:n]
        block_idx, offset = np.divmod(pos, bs)
        dec_slots = self.tables[self._arange[:n], block_idx] * np.int64(bs) + offset  # (int64: no overflow)
        max_blocks = int(self.num_blocks[:n].max()) if n else 0
        model_pos = pos + self.delta[:n]  # (a new array)
        if not prefills:
            input_ids, positions, slots = self.token[:n].copy(), model_pos, dec_slots
            tables = self.tables[:n, :max_blocks].copy()
            seq_lens = (pos + 1).astype(np.int32)
            qsl = self._arange[:n + 1].astype(np.int32)
            prefill_seqs: list[PrefillSeq] = []
        else:
            p_ids: list[int] = []
            p_pos: list[int] = []
            p_slots: list[int] = []
            p_tables: list[list[int]] = []
            p_lens: list[int] = []
            starts = [n]
            p_mrope: list[tuple[int, torch.Tensor]] = []  # (batch offset, [3, k] positions) of M-RoPE chunks
            for r, k in prefills:
                start = r.num_computed_tokens
                table = kv.get_block_ids(r.request_id)
                note_outputs(r, start, k, starts[-1])
                p_ids.extend(r.all_token_ids[start:start + k])
                delta = r.mrope_position_delta
                if r.mrope_positions is not None:
                    p_mrope.append((starts[-1], mrope_positions_at(r.mrope_positions, delta, start, start + k)))
                p_pos.extend(range(start + delta, start + k + delta))
                p_slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + k))
                p_tables.append(table)
                p_lens.append(start + k)
                starts.append(starts[-1] + k)
            input_ids = np.concatenate([self.token[:n], np.array(p_ids, np.int64)])
            positions = np.concatenate([model_pos, np.array(p_pos, np.int64)])
            if p_mrope:  # three streams: t, h, w (equal but on image tokens)
                positions = np.repeat(positions[None], 3, axis=0)
                for at, p3 in p_mrope:
                    positions[:, at:at + p3.shape[1]] = p3.numpy()
            slots = np.concatenate([dec_slots, np.array(p_slots, np.int64)])
            max_blocks = max(max_blocks, max(map(len, p_tables)))
            tables = np.zeros((n + len(prefills), max_blocks), np.int32)
            w = min(max_blocks, self.tables.shape[1])
            tables[:n, :w] = self.tables[:n, :w]
            for j, t in enumerate(p_tables):
                tables[n + j, :len(t)] = t
            seq_lens = np.concatenate([pos + 1, np.array(p_lens, np.int64)]).astype(np.int32)
            qsl = np.concatenate([np.arange(n, dtype=np.int32), np.array(starts, np.int32)])
            prefill_seqs = [PrefillSeq(starts[j], starts[j + 1], p_lens[j]) for j in range(len(prefills))]
            if self.mm_bidirectional:
                for seq, (r, _) in zip(prefill_seqs, prefills):
                    seq.bidirectional = image_spans(r, seq)
        rest = sample_idx + plp_idx
        logits_indices = (np.concatenate([sample_idx_np, np.array(rest, np.int64)]) if rest
                          else sample_idx_np.copy())
        meta = AttentionMetadata(
            slot_mapping=_t(slots, device), num_decode_tokens=n, prefills=prefill_seqs,
            block_tables=_t(tables, device), seq_lens=_t(seq_lens, device), query_start_loc=_t(qsl, device),
            block_size=bs, max_decode_seq_len=int(pos.max()) + 1 if n else 0)
        model_input = ModelInput(
            input_ids=_t(input_ids, device), positions=_t(positions, device), attn_metadata=meta,
            logits_indices=_t(logits_indices, device), block_copies=kv.take_pending_copies(),
            logits_all_rows=plain and not prefills and not rest)
        if self.encoder_cache is not None:
            model_input.mm = self._mm_step(decodes, prefills, n)
        if self.lora_slots is not None:  # the adapter slot of each token, in the batch's order
            model_input.lora = self.lora_slots.batch([(r, 1) for r in decodes] + prefills, device)
        # Until record_sampled says otherwise, no row is known to advance.
        self.steady[:n] = False
        self.generation += 1
        self._sample_src = sample_src
        self._num_rows = n
        fresh = [(decodes[i], 1) for i in unsteady] + prefills if unsteady else prefills
        return StepPlan(model_input, sampling_requests, plp_spans, self.generation, fresh)

    def _mm_step(self, decodes: list[Request], prefills: list[tuple[Request, int]], n: int):
        """The step's MultiModalStep (``image_step``) for decode rows first, then the prefill chunks."""
        spans = [(r, 1, i) for i, r in enumerate(decodes)]
        row = n
        for r, k in prefills:
            spans.append((r, k, row))
            row += k
        return image_step(self.encoder_cache, spans)

    def record_sampled(self, plan: StepPlan, token_ids: Sequence[int]) -> None:
        """The tokens sampled from ``plan``'s logits (``token_ids[j]`` for ``plan.sampling_requests[j]``):
        each decode row that sampled its own next token advances (position + 1, that token its next
        input). Ignored unless ``plan`` is the latest batch made (the rows may have moved since)."""
        n, src = self._num_rows, self._sample_src
        if plan.generation != self.generation or n <= 0:
            return
        self._num_rows = -1
        if src is None:  # every row sampled its own token, row i token i
            self.token[:n] = token_ids[:n]
            self.pos[:n] += 1
            self.steady[:n] = True
            return
        rows = np.flatnonzero(src >= 0)
        self.token[rows] = np.asarray(token_ids, np.int64)[src[rows]]
        self.pos[rows] += 1
        self.steady[rows] = True
