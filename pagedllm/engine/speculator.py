"""The engine's side of speculative decoding (``--speculative-config``): which sequences propose, the
verification batch, the rejection sampling of its rows, rolling back what was rejected.

A step with speculation (vLLM v1's design, ``vllm/v1/spec_decode`` and its scheduler):

1. ``propose`` (before ``Scheduler.schedule``): every running sequence in decode state whose sampling
   can be served exactly gets up to k proposals in ``Request.spec_token_ids`` (the n-gram proposer, the
   draft model's k autoregressive steps, or the checkpoint's MTP layer fed the target's hidden states).
   The scheduler gives it 1 + k new tokens (its last sampled token and the proposals), so
   ``allocate_slots`` holds slots for them; the prefix cache hashes only ``all_token_ids``, never proposals.
2. ``prepare_inputs``: one target forward pass over the whole batch; a sequence with proposals is a
   query of 1 + k tokens over its cached prefix (the paged backends' chunked-prefill path), with a
   logits row at every one of its positions.
3. ``verify``: ``spec_decode/rejection_sampler.py`` turns each such sequence's k + 1 rows into the
   tokens it emits (accepted proposals, then one more); they are appended as if sampled in turn (the
   stop checks run token by token, so nothing past a stop is kept), ``num_computed_tokens`` advances
   by what was accepted only, and the blocks that held only rejected positions go back to the pool at
   once (``KVCacheManager.trim``). Under mtp every step's batch is built here, with the target's hidden
   states returned (``ModelInput.return_hidden``), and the rows of the positions made final are handed to
   the MTP proposer (``spec_decode/mtp.py``).

Sequences whose sampling cannot be served exactly decode without proposals, said once in the log:
structured outputs (the grammar state does not roll back here) and stop strings (text past a stop
would be emitted). Proposals are off in a step with more running sequences than
``disable_by_batch_size`` (where verification costs more than it saves).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.engine.input_batch import image_spans, image_step, mrope_positions
from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.request import Request, banned_token_ids
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.layers.sampler import Sampler, SamplingRow, target_probs, topk_logprobs
from pagedllm.platforms import ops
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.drafting import FlatRows
from pagedllm.spec_decode.mtp import MTPProposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.rejection_sampler import rejection_sample
from pagedllm.worker.model_input import ModelInput

logger = logging.getLogger("pagedllm")


def _tensor(values: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass
class SpecStepPlan:
    """What ``engine/input_batch.py``'s ``StepPlan`` holds (the model input, the sampling requests of
    its first rows, the prompt-logprob spans of the next), and the rows of the sequences verifying
    proposals after them: ``spec`` lists (request, its proposals verified this step, first row); each
    has k + 1 rows."""

    model_input: ModelInput
    sampling_requests: list[Request]
    prompt_logprob_spans: list[tuple[Request, int, int]]
    spec: list[tuple[Request, list[int], int]] = field(default_factory=list)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [k, V] (draft model)
    fresh: list[tuple[Request, int]] = field(default_factory=list)  # every scheduled (request, tokens), as StepPlan's
    # mtp: (request, first position, tokens, first row of the pass, fork children) of every scheduled
    # sequence, and the pass's hidden states [N, hidden] (set by the engine)
    layout: list[tuple[Request, int, int, int, list[Request]]] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None


def make_draft_proposer(config: EngineConfig, executor) -> Optional[DraftModelProposer | MTPProposer]:
    """The proposer with a KV cache of its own, loaded now: the draft model for method draft_model (with a
    block manager of its own, no prefix caching), the checkpoint's MTP layer for mtp (beside the target
    model of ``executor``, a ``UniProcExecutor``); None for ngram."""
    method = config.speculative_config.method
    if method == "mtp":
        return MTPProposer(config, executor.runner.model, executor.runner)
    if method != "draft_model":
        return None
    return DraftModelProposer(config, lambda n: KVCacheManager(n, config.cache_config.block_size,
                                                               enable_caching=False))


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: ``num_drafts`` (sequence-steps that verified proposals),
    ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos[j]`` (proposal j + 1 accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying sequence-step: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Args: config (with ``speculative_config`` set); kv: the target's KV-cache manager; scheduler;
    sampler: the engine's (its ``process`` gives the target's processed logits); eos_token_id;
    draft: ``make_draft_proposer``'s (the draft model's or the MTP layer's proposer), None for ngram."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, scheduler: Scheduler, sampler: Sampler,
                 eos_token_id: Optional[int], draft=None) -> None:
        spec: SpeculativeConfig = config.speculative_config
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.kv = kv
        self.scheduler = scheduler
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        self.max_model_len = config.scheduler_config.max_model_len
        self.device = config.device
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else None
        self.draft = draft if spec.method == "draft_model" else None
        self.mtp: Optional[MTPProposer] = draft if spec.method == "mtp" else None
        if self.mtp is not None:
            self.mtp.kv = kv  # its cache is indexed by the target's block tables
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._said: set[str] = set()
        self.propose_seconds = 0.0
        # for an image-text model (set by the engine, as InputBatch's): the encoder cache's plan, whether image
        # tokens attend both ways
        self.encoder_cache = None
        self.mm_bidirectional = False
        self.lora_slots = None  # under --enable-lora (set by the engine): the LoRASlotTable of the target

    def startup_line(self) -> str:
        s = self.spec
        if s.method == "ngram":
            how = f"n-gram prompt lookup, n={s.prompt_lookup_max}..{s.prompt_lookup_min}"
        elif s.method == "mtp":
            how = self.mtp.describe()
        else:
            how = f"draft model {s.model}" + (f" ({s.draft_quantization})" if s.draft_quantization else "")
        off = (f"; off in steps with more than {s.disable_by_batch_size} running sequences"
               if s.disable_by_batch_size else "")
        return (f"speculative decoding: {s.method} ({how}), k={self.k} proposals a sequence a step, verified in one "
                f"target pass by rejection sampling (the output distribution is the model's){off}")

    # ---- 1. proposals ------------------------------------------------------------------------
    def _why_not(self, r: Request) -> Optional[str]:
        sp = r.sampling_params
        if r.grammar is not None:
            return "structured outputs (a rejected grammar state does not roll back here)"
        if sp.stop:
            return "stop strings (text past a stop string would be emitted)"
        return None

    def propose(self) -> None:
        """Set ``spec_token_ids`` of every running sequence (empty where it does not propose)."""
        t0 = time.perf_counter()
        running = self.scheduler.running
        limit = self.spec.disable_by_batch_size
        off = limit is not None and self.scheduler.num_running_seqs() > limit
        wants: list[tuple[Request, int]] = []
        eligible: list[Request] = []  # (mtp: sequences whose MTP entries are fed, proposing now or later)
        for r in running:
            r.spec_token_ids = []
            if self.mtp is not None and self._why_not(r) is None:
                eligible.append(r)
            if off:
                continue
            num = len(r.all_token_ids)
            if r.num_computed_tokens != num - 1 or r.request_id in self.scheduler.forks:
                continue  # a prefill (or the leader of samples still to fork): no proposals
            # emitted tokens (accepted + 1) within max_tokens, positions within max_model_len
            k = min(self.k, r.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - num)
            if k <= 0:
                continue
            why = self._why_not(r)
            if why is not None:
                if why not in self._said:
                    self._said.add(why)
                    logger.info("speculative decoding: no proposals for requests with %s; they decode one token "
                                "a step", why)
                continue
            wants.append((r, k))
        if self.ngram is not None:
            for r, k in wants:
                r.spec_token_ids = self.ngram.propose(r.all_token_ids, k)
        elif self.draft is not None:
            self.draft.free_others({r.request_id for r in running})
            if wants:
                for (r, _), drafts in zip(wants, self.draft.propose(wants)):
                    r.spec_token_ids = drafts
        elif self.mtp is not None:
            self.mtp.free_others({r.request_id for r in eligible})
            for (r, _), drafts in zip(wants, self.mtp.propose(eligible, wants)):
                r.spec_token_ids = drafts
        self.propose_seconds += time.perf_counter() - t0

    def release_finished(self) -> None:
        """Free the draft cache's blocks (forget the MTP layer's pending hidden states) of sequences no
        longer running (after a step's updates)."""
        if self.draft is not None and self.draft.fed:
            self.draft.free_others({r.request_id for r in self.scheduler.running})
        if self.mtp is not None and self.mtp.pending:
            self.mtp.free_others({r.request_id for r in self.scheduler.running})

    # ---- 2. the verification batch -------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput, forks: dict[str, list[Request]]) -> Optional[SpecStepPlan]:
        """The step's flat batch where some scheduled sequence verifies proposals, or under mtp every
        step's (None: the engine's ``prepare_inputs`` builds it). Rows: sampling rows of the others (as
        ``engine/input_batch.py``), their prompt-logprob rows, then k + 1 rows per verifying sequence."""
        entries = []
        any_spec = False
        for r, n in out.scheduled:
            pending = len(r.all_token_ids) - r.num_computed_tokens
            drafts = r.spec_token_ids[:n - pending] if r.spec_token_ids and n > pending else []
            any_spec |= bool(drafts)
            entries.append((r, n, drafts))
        if not any_spec and self.mtp is None:
            return None
        bs = self.kv.block_size
        entries.sort(key=lambda e: e[1] != 1)  # one-token sequences first (stable)
        flat = FlatRows()
        sample_idx: list[int] = []
        sampling_requests: list[Request] = []
        plp_idx: list[int] = []
        plp_spans = []
        spec_idx: list[int] = []
        spec = []
        layout = []
        for r, n, drafts in entries:
            start = r.num_computed_tokens
            offset = len(flat.ids)
            layout.append((r, start, n, offset, forks.get(r.request_id, [])))
            table = self.kv.get_block_ids(r.request_id)
            toks = r.all_token_ids[start:start + n] if not drafts else r.all_token_ids[start:] + drafts
            if drafts:
                spec.append((r, drafts, len(spec_idx)))
                spec_idx.extend(range(offset, offset + n))
            else:
                if start + n == len(r.all_token_ids):
                    for s in [r, *forks.get(r.request_id, ())]:
                        sample_idx.append(offset + n - 1)
                        sampling_requests.append(s)
                if r.sampling_params.prompt_logprobs is not None:
                    first = max(start, len(r.prompt_logprobs) - 1)
                    last = min(start + n, r.num_prompt_tokens - 1)
                    if last > first:
                        plp_idx.extend(range(offset + first - start, offset + last - start))
                        plp_spans.append((r, first + 1, last - first))
            flat.add(toks, start, table, bs)
        head = len(sample_idx) + len(plp_idx)
        spec = [(r, d, head + row) for r, d, row in spec]
        dev = self.device
        input_ids, positions, meta = flat.tensors(bs, dev)
        model_input = ModelInput(
            input_ids=input_ids, positions=positions,
            attn_metadata=meta, logits_indices=_tensor(sample_idx + plp_idx + spec_idx, torch.long, dev),
            block_copies=self.kv.take_pending_copies(), return_hidden=self.mtp is not None)
        if self.mtp is not None:
            self.mtp.copy_blocks(model_input.block_copies)
        if self.lora_slots is not None:  # each token's adapter slot (proposals verify under their adapter)
            model_input.lora = self.lora_slots.batch([(r, n) for r, n, _ in entries], dev)
        if self.encoder_cache is not None:  # image tokens of the prompt chunks beside the verifications
            rows, offset = [], 0
            for r, n, _ in entries:
                rows.append((r, n, offset))
                offset += n
            model_input.mm = image_step(self.encoder_cache, rows)
            if self.mm_bidirectional:
                nd = meta.num_decode_tokens
                for seq, (r, _, _) in zip(meta.prefills, entries[nd:]):
                    seq.bidirectional = image_spans(r, seq)
            nd = meta.num_decode_tokens
            pos3 = mrope_positions(np.asarray(flat.positions, np.int64), [e[0] for e in entries[:nd]],
                                   [(r, n) for r, n, _ in entries[nd:]], nd)
            if pos3.ndim == 2:  # an M-RoPE request among them
                model_input.positions = torch.from_numpy(pos3).to(dev)
        draft_probs = {}
        proposer = self.draft or self.mtp
        if proposer is not None:
            draft_probs = {r.request_id: proposer.last_probs[r.request_id][:len(d)] for r, d, _ in spec
                           if r.request_id in proposer.last_probs}
        return SpecStepPlan(model_input, sampling_requests, plp_spans, spec=spec, draft_probs=draft_probs,
                            fresh=[(r, n) for r, n, _ in entries], layout=layout if self.mtp is not None else [])

    # ---- 3. verification --------------------------------------------------------------------------
    def _banned(self, r: Request, num_out: int) -> Optional[list[int]]:
        """EOS and stop token ids while ``num_out`` < min_tokens (as ``LLMEngine._banned_token_ids``)."""
        return banned_token_ids(r.sampling_params, num_out, self.eos_token_id)

    def verify(self, plan: SpecStepPlan, logits: torch.Tensor, out: SchedulerOutput,
               make_logprobs) -> tuple[SchedulerOutput, dict[str, int], int]:
        """Rejection-sample the verifying sequences' rows of ``logits`` [M, V] (float32).

        Appends each sequence's accepted tokens but the last emitted one, which is returned as its sampled
        token for ``Scheduler.update_from_output`` (with the schedule adjusted to advance
        ``num_computed_tokens`` by the accepted tokens only), and frees the blocks that held only rejected
        positions; under mtp hands the hidden states of the positions made final to the MTP proposer.
        Returns (adjusted schedule, request id -> last token, tokens appended here).
        """
        if not plan.spec:  # (mtp: a step without proposals)
            self._keep_hidden(plan, {})
            return out, {}, 0
        rows: list[SamplingRow] = []
        for r, drafts, _ in plan.spec:
            out_ids = r.output_token_ids
            for j in range(len(drafts) + 1):
                seen = out_ids + drafts[:j] if j else out_ids
                rows.append(SamplingRow(r.sampling_params, r.generator, r.prompt_token_ids, seen,
                                        self._banned(r, len(out_ids) + j), None))
        first = plan.spec[0][2]
        raw = logits[first:first + len(rows)].float()
        processed = self.sampler.process(raw, rows)
        argmax = ops.argmax_rows(processed)
        greedy = [r.sampling_params.greedy for r, _, _ in plan.spec]
        probs = None if all(greedy) else target_probs(processed, rows)
        draft_probs = None
        if plan.draft_probs:
            draft_probs = [plan.draft_probs.get(r.request_id) for r, _, _ in plan.spec]
        results = rejection_sample(probs, argmax, greedy, [d for _, d, _ in plan.spec], draft_probs,
                                   [r.generator for r, _, _ in plan.spec])
        want_lp = any(r.sampling_params.logprobs is not None for r, _, _ in plan.spec)
        raw_lp = raw.log_softmax(dim=-1) if want_lp else None
        sampled: dict[str, int] = {}
        new_n: dict[str, int] = {}
        appended = 0
        st = self.stats
        row = 0
        for (r, drafts, _), res in zip(plan.spec, results):
            st.num_drafts += 1
            st.num_draft_tokens += len(drafts)
            st.num_accepted_tokens += res.num_accepted
            for j in range(res.num_accepted):
                st.accepted_per_pos[j] += 1
            toks = res.token_ids
            for i, tok in enumerate(toks[:-1]):  # as if sampled one at a time: stop at the first stop
                r.output_token_ids.append(tok)
                r.all_token_ids.append(tok)
                if self.scheduler._check_stop(r, tok) is not None:  # noqa: SLF001 - the scheduler's own rule
                    r.output_token_ids.pop()
                    r.all_token_ids.pop()
                    toks = toks[:i + 1]
                    break
            if raw_lp is not None and r.sampling_params.logprobs is not None:
                for j, tok in enumerate(toks):
                    lp = topk_logprobs(raw_lp[row + j], tok, r.sampling_params.logprobs)
                    r.logprobs.append(make_logprobs(lp, tok))
                    r.cumulative_logprob += lp[0]
            num_manual = len(toks) - 1
            appended += num_manual
            sampled[r.request_id] = toks[-1]
            new_n[r.request_id] = 1 + num_manual
            # K/V is right for positions < num_computed + 1 + num_manual; later slots held rejected tokens
            self.kv.trim(r, cdiv(r.num_computed_tokens + 1 + num_manual, self.kv.block_size))
            row += len(drafts) + 1
        scheduled = [(r, new_n.get(r.request_id, n)) for r, n in out.scheduled]
        adjusted = SchedulerOutput(scheduled=scheduled, preempted=out.preempted,
                                   total_num_scheduled_tokens=out.total_num_scheduled_tokens)
        for r, _, _ in plan.spec:
            r.spec_token_ids = []
        self._keep_hidden(plan, new_n)
        return adjusted, sampled, appended

    def _keep_hidden(self, plan: SpecStepPlan, new_n: dict[str, int]) -> None:
        """mtp: each scheduled sequence's hidden rows of the positions the pass made final (all of them,
        or a verifying sequence's ``new_n``) to the MTP proposer, for its fork children too."""
        if self.mtp is None or plan.hidden is None:
            return
        for r, start, n, offset, children in plan.layout:
            rows = plan.hidden[offset:offset + new_n.get(r.request_id, n)]
            for s in (r, *children):
                self.mtp.keep_hidden(s, start, rows)
        plan.hidden = None
