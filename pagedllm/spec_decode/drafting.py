"""Drawing proposals from a proposer's logits (the draft model's, the MTP layer's) under each request's
sampling parameters, so that the rejection sampler can verify them exactly.

The logits go through the request's penalties, logit_bias, allowed and bad tokens (``Sampler.process``,
as the target's will: proposals the target would never take are not made), then temperature, top-k,
top-p and min-p (``target_probs``): q. A greedy request's proposal is q's argmax; another's is drawn
from q with the request's own generator where it is seeded, and q goes to the rejection sampler.
"""
from __future__ import annotations

import torch

from pagedllm.engine.request import Request
from pagedllm.layers.sampler import Sampler, SamplingRow, target_probs
from pagedllm.platforms import ops


def draw_proposals(sampler: Sampler, logits: torch.Tensor, requests: list[Request], out: dict[str, list[int]],
                   probs: dict[str, list[torch.Tensor]]) -> None:
    """One proposal per request, appended to ``out[request_id]`` (its proposals so far, which count as
    output for the penalties); for a sampled request q [V] float32 is appended to ``probs[request_id]``.

    Args:
        logits: [len(requests), V] float32, the proposer's raw logits at each request's next position.
    """
    greedy = [r.sampling_params.greedy for r in requests]
    rows = [SamplingRow(r.sampling_params, None, r.prompt_token_ids, r.output_token_ids + out[r.request_id])
            for r in requests]
    logits = sampler.process(logits, rows)
    tokens = ops.argmax_rows(logits).tolist()
    if not all(greedy):
        q = target_probs(logits, rows)
        for i, r in enumerate(requests):
            if not greedy[i]:
                tokens[i] = int(torch.multinomial(q[i], 1, generator=r.generator))
                probs[r.request_id].append(q[i])
    for r, tok in zip(requests, tokens):
        out[r.request_id].append(tok)
