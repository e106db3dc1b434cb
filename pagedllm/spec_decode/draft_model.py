"""Draft-model proposer (vLLM's ``draft_model`` method; Leviathan et al. 2023): a smaller model with the
target's vocabulary runs k autoregressive steps a sequence, in this process, over its own paged KV
cache (as many blocks as the target's, sized from the same budget: ``LLMEngine._init_kv_cache``).

Each ``propose`` call first feeds every sequence the tokens its draft cache lacks (a multi-token query:
after the first step, the accepted proposals' K/V are already there and only the last one or two
tokens are new), then k - 1 one-token steps. The draft's K/V is right for a position while the token
it was fed there is still the sequence's token: the first ``min(fed, target num_computed_tokens)``
positions, as the target's computed tokens never change; the rest is simply written again.

Proposals are drawn from the draft's distribution under the request's sampling parameters
(``spec_decode/drafting.py``); that distribution goes to the rejection sampler as q (``last_probs``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import get_pp_state, get_tp_rank, get_tp_size, set_pp_state, set_tp_state
from pagedllm.layers.sampler import Sampler
from pagedllm.spec_decode.drafting import draw_proposals, proposer_batch
from pagedllm.worker.model_input import ModelInput
from pagedllm.worker.model_runner import ModelRunner


class DraftSeq:
    """What the draft's block manager reads of a sequence (``KVCacheManager`` takes any such object)."""

    __slots__ = ("request_id", "num_computed_tokens", "all_token_ids", "block_hashes", "kv_free_end")

    def __init__(self, request_id: str, num_computed_tokens: int = 0) -> None:
        self.request_id = request_id
        self.num_computed_tokens = num_computed_tokens
        self.all_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.kv_free_end = 0  # (written by KVCacheManager.allocate_slots: Request.kv_free_end)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    """Args: config: the engine's (``speculative_config.draft_model_config`` is the draft's model);
    make_kv: num_blocks -> a block manager without prefix caching (``engine/kv_cache_manager.py``)."""

    def __init__(self, config: EngineConfig, make_kv: Callable[[int], object]) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        # (no LoRA on the draft: a LoRA request's proposals come from the base draft and are verified by the
        # target under its adapter, so the output is the adapter's; only the acceptance rate can be lower)
        draft_config = dataclasses.replace(config, model_config=spec.draft_model_config, speculative_config=None,
                                           lora_config=None)
        prev, prev_pp = (get_tp_rank(), get_tp_size()), get_pp_state()
        set_tp_state(0, 1)  # the draft is unsharded
        set_pp_state(0, 1)
        try:
            self.runner = ModelRunner(draft_config)
        finally:
            set_tp_state(*prev)
            set_pp_state(*prev_pp)
        self.device = config.device
        self.block_size = config.cache_config.block_size
        self.make_kv = make_kv
        self.kv = None
        self.fed: dict[str, int] = {}  # request id -> positions fed to the draft (its K/V written)
        self.last_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] float32 of its last proposals
        self.sampler = Sampler()

    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = self.make_kv(num_blocks)

    def free_others(self, live: set[str]) -> None:
        """Free the draft blocks of sequences no longer running (finished, aborted, preempted)."""
        for rid in [rid for rid in self.fed if rid not in live]:
            self.kv.free(DraftSeq(rid))
            del self.fed[rid]
            self.last_probs.pop(rid, None)

    def _forward(self, seqs: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """One draft pass: ``seqs`` = (request id, new tokens, first position), one-token ones first ->
        float32 logits [len(seqs), V] at each sequence's last new token."""
        ids, pos, meta, last = proposer_batch([(toks, start, self.kv.get_block_ids(rid)) for rid, toks, start in seqs],
                                              self.block_size, self.device)
        return self.runner.execute_model(ModelInput(input_ids=ids, positions=pos, attn_metadata=meta,
                                                    logits_indices=last)).float()

    def propose(self, wants: list) -> list[list[int]]:
        """``wants``: (request, k) of sequences in decode state -> their proposals (up to k each; none
        where the draft's pool has no room)."""
        live = []  # (request, k, seq)
        out: dict[str, list[int]] = {}
        for r, k in wants:
            rid = r.request_id
            num = len(r.all_token_ids)
            valid = min(self.fed.get(rid, 0), r.num_computed_tokens)
            seq = DraftSeq(rid, valid)
            # positions valid .. num + k - 2: the missing tokens, then proposals 1 .. k - 1
            if not self.kv.allocate_slots(seq, num - valid + k - 1):
                continue
            live.append((r, k, valid))
            out[rid] = []
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in live}
        for step in range(max((k for _, k, _ in live), default=0)):
            batch = []
            for r, k, valid in live:
                if step >= k:
                    continue
                rid = r.request_id
                if step == 0:
                    batch.append((r, r.all_token_ids[valid:], valid))
                else:
                    batch.append((r, out[rid][-1:], len(r.all_token_ids) + step - 1))
            batch.sort(key=lambda b: len(b[1]) != 1)
            logits = self._forward([(r.request_id, toks, start) for r, toks, start in batch])
            draw_proposals(self.sampler, logits, [r for r, _, _ in batch], out, probs)
        for r, k, _ in live:
            rid = r.request_id
            self.fed[rid] = len(r.all_token_ids) + k - 1
            if probs[rid]:
                self.last_probs[rid] = torch.stack(probs[rid])
            else:
                self.last_probs.pop(rid, None)
        return [out.get(r.request_id, []) for r, _ in wants]


