"""Rejection sampling of proposed tokens against the target model (Leviathan et al., "Fast Inference
from Transformers via Speculative Decoding", ICML 2023, Algorithm 1; Chen et al., "Accelerating Large
Language Model Decoding with Speculative Sampling", 2023): the emitted tokens follow the target's
distribution exactly, whatever the proposals.

For a sequence with proposals d_1..d_k, the target gives distributions p_1..p_{k+1} (one per verified
position, after every sampling parameter: penalties, logit_bias, bans, temperature, top-k/p, min-p;
``Sampler.process`` then ``target_probs``). Proposal j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's distribution (a point mass for n-gram proposals:
accept with probability p_j(d_j)); at the first rejection a token is drawn from the residual
max(0, p_j - q_j), normalized (for a point mass: p_j with d_j removed), and the rest are dropped; if
all k are accepted a bonus token is drawn from p_{k+1}. Greedy rows accept while d_j is the argmax,
then emit the argmax: the same tokens as decoding without proposals.

Draws come from each sequence's own generator where it is seeded (``SamplingParams.seed``), so a
seeded request's output does not depend on the batch; sampling is the exponential race as in
``layers/sampler.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.platforms import ops


@dataclass
class Verified:
    """One sequence's result: ``token_ids`` emitted (accepted proposals, then one more), and how many
    proposals were accepted (``num_accepted`` = len(token_ids) - 1)."""

    token_ids: list[int]
    num_accepted: int


def rejection_sample(probs: Optional[torch.Tensor], argmax: torch.Tensor, greedy: list[bool],
                     draft_token_ids: list[list[int]], draft_probs: Optional[list[Optional[torch.Tensor]]],
                     generators: list[Optional[torch.Generator]]) -> list[Verified]:
    """Verify the proposals of S sequences.

    Args:
        probs: [R, V] float32 target probabilities of every row (None when every sequence is greedy);
            sequence s owns k_s + 1 consecutive rows (R = sum(k_s + 1)), the last for its bonus token.
        argmax: [R] int64 argmax of each row's processed logits (the greedy token).
        greedy: per sequence.
        draft_token_ids: per sequence its k_s proposals.
        draft_probs: per sequence a [k_s, V] float32 draft distribution, or None (a point mass at each
            proposal: n-gram); None for all point masses.
        generators: per sequence its torch.Generator, or None (the global one).
    Returns:
        one ``Verified`` per sequence.
    """
    out: list[Verified] = []
    arg = argmax.tolist()
    row = 0
    for s, drafts in enumerate(draft_token_ids):
        k = len(drafts)
        if greedy[s]:
            m = 0
            while m < k and drafts[m] == arg[row + m]:
                m += 1
            out.append(Verified(drafts[:m] + [arg[row + m]], m))
            row += k + 1
            continue
        p = probs[row:row + k + 1]
        gen = generators[s]
        dev = p.device
        u = torch.rand(k, generator=gen, device=dev) if k else None
        race = torch.empty_like(p).exponential_(generator=gen)  # one draw a row (exponential race)
        idx = torch.tensor(drafts, dtype=torch.long, device=dev)
        q = draft_probs[s] if draft_probs is not None else None
        p_d = p[:k].gather(1, idx.unsqueeze(1)).squeeze(1) if k else None
        if k:
            if q is None:
                accept = (u < p_d).tolist()
            else:
                q_d = q.gather(1, idx.unsqueeze(1)).squeeze(1)
                accept = (u * q_d < p_d).tolist()  # u < p/q without dividing by a zero q
        m = 0
        while m < k and accept[m]:
            m += 1
        if m < k:  # the residual max(0, p - q) at the first rejection, normalized
            if q is None:
                residual = p[m].clone()
                residual[drafts[m]] = 0.0
            else:
                residual = (p[m] - q[m]).clamp_min_(0.0)
            if not bool(residual.sum() > 0):  # p == q up to rounding: then p itself
                residual = p[m]
            tok = int(ops.argmax_rows((residual / race[m]).unsqueeze(0))[0])
        else:
            tok = int(ops.argmax_rows((p[k] / race[k]).unsqueeze(0))[0])
        out.append(Verified(drafts[:m] + [tok], m))
        row += k + 1
    return out
