"""MTP proposer (vLLM's ``mtp`` method, formerly ``deepseek_mtp`` / ``glm4_moe_mtp``): the checkpoint's own
multi-token-prediction layer (``models/mtp.py``) proposes k tokens a sequence from the target's last
hidden states, in this process, beside the target model (tensor and pipeline parallel size 1).

Its KV cache is one layer's, indexed by the target's block tables: block b of a request holds the MTP
layer's K/V of the same positions as the target's block b (vLLM keeps the drafter's layers in the
target's KV-cache groups alike). So the cache costs one more layer per block, from the same budget
(``LLMEngine._init_kv_cache``); blocks return to the pool with the target's; a prefix-cache hit brings
the MTP entries of its positions along; copy-on-write copies (``block_copies``) are applied to it too.
Positions past the target's blocks (proposals 2..k of the chain) go to ``scratch`` blocks of its own,
one set per sequence of the pass.

The MTP layer's entry at position i needs h_i (the target's hidden state at i, from the pass that
computed i) and t_{i+1}. After each target pass the speculator hands over (``keep_hidden``) the rows of
the positions that pass made final (all of a prefill chunk; a verifying sequence's accepted ones); at
the next ``propose`` they are fed (``pending``): one MTP pass over every running sequence's new positions
(a multi-token query over its cached prefix), whose last row, at position n - 2 of a sequence of n
tokens (its last token t_{n-1} sampled, not yet computed), gives the logits of t_n: proposal 1.
Proposal j + 1 feeds proposal j at the next position with the layer's own output h' as its h, as vLLM
does. Proposals are drawn as the draft model's (``spec_decode/drafting.py``), q kept for the rejection
sampler (``last_probs``).

A sequence without new hidden states (not scheduled in the last step) proposes nothing this step. With
n > 1 the samples share the prompt's blocks until copy-on-write splits them, so the MTP entry of the
prompt's last position is the last writer's: proposals of the others can be worse there (never the
output: it is verified).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.quantization import get_quantization_config, process_weights_after_loading
from pagedllm.layers.sampler import Sampler
from pagedllm.models.loader import checkpoint_tensors
from pagedllm.models.mtp import make_mtp_predictor, mtp_checkpoint_weights, num_mtp_layers
from pagedllm.spec_decode.drafting import draw_proposals, proposer_batch

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_manager import KVCacheManager
    from pagedllm.engine.request import Request


class MTPProposer:
    """Args: config: the engine's; target: the loaded target model (this process's ``ModelRunner.model``);
    runner: its ModelRunner (the cache's dtype and shape). Loads the MTP layer's weights now.

    Raises:
        ValueError: the checkpoint lacks the MTP layer's weights (names them).
    """

    def __init__(self, config: EngineConfig, target, runner) -> None:
        mc = config.model_config
        self.k = config.speculative_config.num_speculative_tokens
        self.device = config.device
        self.block_size = config.cache_config.block_size
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        with torch.device(self.device):
            self.layer = make_mtp_predictor(target, mc.dtype)
        try:
            self.layer.load_weights(mtp_checkpoint_weights(lambda keep: checkpoint_tensors(mc, keep), target,
                                                           self.layer))
        except ValueError as e:
            raise ValueError(f"speculative_config: method mtp: {mc.model} lacks its multi-token-prediction layer "
                             f"({self.layer.prefix}*): {e}") from None
        process_weights_after_loading(self.layer, get_quantization_config(mc.quantization))
        self.layer.eval()
        self.kv_shape = (runner.kv_planes, runner.kv_block_rows, runner.num_kv_heads, runner.head_dim)
        self.kv_dtype = runner.kv_cache_dtype
        self.kv: Optional["KVCacheManager"] = None  # the target's (set by the speculator: its tables index this cache)
        self.cache: Optional[torch.Tensor] = None
        self.scratch_base = 0
        self.scratch_per_seq = -(-self.k // self.block_size) + 1  # blocks past a sequence's own for the chain
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (first position, hidden rows)
        self.last_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] float32 of its last proposals
        self.sampler = Sampler()
        self.num_layers = num_mtp_layers(mc.hf_config)

    def describe(self) -> str:
        extra = f", the first of {self.num_layers}" if self.num_layers > 1 else ""
        return f"the checkpoint's multi-token-prediction layer ({self.layer.prefix.rstrip('.')}{extra})"

    def bytes_per_block(self) -> int:
        planes, rows, heads, dim = self.kv_shape
        return planes * rows * heads * dim * self.kv_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One layer's cache over the target's ``num_blocks`` block ids, then the chain's scratch blocks
        (zeroed: an entry read before it is written, e.g. a prefix-cache hit's last position, is finite)."""
        planes, rows, heads, dim = self.kv_shape
        self.scratch_base = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_seq
        self.cache = torch.zeros(planes, total, rows, heads, dim, dtype=self.kv_dtype, device=self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target's copy-on-write copies (src, dst), on this cache too."""
        if copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies))
            self.cache[:, dst] = self.cache[:, src]

    # ---- the target's hidden states ----------------------------------------------------------------
    def keep_hidden(self, r: "Request", start: int, rows: torch.Tensor) -> None:
        """``rows`` [m, H]: the target's final hidden states of positions start .. start + m - 1 of ``r``, made
        final by the last pass (appended to what is pending; after a rollback or a recompute, from there)."""
        held = self.pending.get(r.request_id)
        if held is not None and held[0] < start <= held[0] + held[1].shape[0]:
            rows = torch.cat([held[1][:start - held[0]], rows])
            start = held[0]
        self.pending[r.request_id] = (start, rows)

    def free_others(self, live: set[str]) -> None:
        """Forget the sequences no longer running (finished, aborted, preempted)."""
        for d in (self.pending, self.last_probs):
            for rid in [rid for rid in d if rid not in live]:
                del d[rid]

    # ---- proposals ------------------------------------------------------------------------------------
    def _forward(self, seqs: list[tuple]) -> torch.Tensor:
        """One MTP pass: ``seqs`` = (request, tokens t_{p+1}, first position p, hidden [len, H], block
        table), one-token ones first -> h' [sum of lengths, H]."""
        ids, pos, meta, _ = proposer_batch([(toks, start, table) for _, toks, start, _, table in seqs],
                                           self.block_size, self.device)
        return self.layer(ids, pos, torch.cat([h for _, _, _, h, _ in seqs]), self.cache, meta)

    @torch.inference_mode()
    def propose(self, eligible: list["Request"], wants: list[tuple["Request", int]]) -> list[list[int]]:
        """Feed the pending hidden states of ``eligible`` (running sequences that may propose, now or once
        their prefill is done), and make up to k proposals for each of ``wants`` ((request, k), in decode
        state) -> their proposals, in order (none for a sequence without new hidden states)."""
        k_of = {r.request_id: k for r, k in wants}
        feed = []  # (request, tokens, first position, hidden, table)
        for r in eligible:
            held = self.pending.pop(r.request_id, None)
            if held is None:
                continue
            start, rows = held
            m = min(rows.shape[0], r.num_computed_tokens - start)  # positions the target has computed
            if m <= 0:
                continue
            feed.append((r, r.all_token_ids[start + 1:start + 1 + m], start, rows[:m],
                         self.kv.get_block_ids(r.request_id)))
        out: dict[str, list[int]] = {}
        if not feed:
            return [[] for _ in wants]
        feed.sort(key=lambda f: len(f[1]) != 1)
        h = self._forward(feed)
        # the sequences proposing: their last fed position is n - 2 (the last computed one)
        chain = []  # (request, k, h' row, table)
        row = 0
        for r, toks, start, _, table in feed:
            row += len(toks)
            k = k_of.get(r.request_id, 0)
            if k and start + len(toks) == len(r.all_token_ids) - 1:
                chain.append((r, k, h[row - 1:row], table))
        probs: dict[str, list[torch.Tensor]] = {}
        for step in range(max((k for _, k, _, _ in chain), default=0)):
            if step:
                batch = []
                for i, (r, k, prev, table) in enumerate(chain):
                    if step < k:
                        p = len(r.all_token_ids) - 2 + step
                        batch.append((r, [out[r.request_id][-1]], p, prev, self._with_scratch(table, i, p)))
                h = self._forward(batch)
                nxt = {id(b[0]): h[j:j + 1] for j, b in enumerate(batch)}
                chain = [(r, k, nxt.get(id(r), prev), t) for r, k, prev, t in chain]
            live = [(r, prev) for r, k, prev, _ in chain if step < k]
            for r, _ in live:
                out.setdefault(r.request_id, [])
                probs.setdefault(r.request_id, [])
            logits = self.layer.compute_logits(torch.cat([prev for _, prev in live]))
            draw_proposals(self.sampler, logits, [r for r, _ in live], out, probs)
        for rid, qs in probs.items():
            if qs:
                self.last_probs[rid] = torch.stack(qs)
            else:
                self.last_probs.pop(rid, None)
        return [out.get(r.request_id, []) for r, _ in wants]

    def _with_scratch(self, table: list[int], i: int, position: int) -> list[int]:
        """``table`` extended by sequence ``i``'s scratch blocks to cover ``position``."""
        need = position // self.block_size + 1 - len(table)
        if need <= 0:
            return table
        first = self.scratch_base + i * self.scratch_per_seq
        return table + list(range(first, first + need))
