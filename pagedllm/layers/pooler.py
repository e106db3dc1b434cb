"""Embeddings of the pooling runner (``--runner pooling``, vLLM's): a prompt's embedding is the final
(normed) hidden state of its last token, L2-normalized, as decoder-only embedding models are trained
and used (Wang et al., 2024, "Improving Text Embeddings with Large Language Models" (E5-Mistral);
Qwen3-Embedding; vLLM's ``LAST`` pooling with ``normalize``). The engine computes it where a
generating model would compute the next token's logits, so chunked prefill and prefix caching
apply unchanged."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def last_token_embeddings(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [M, hidden_size] (each prompt's last position, after the final norm) -> float32
    [M, hidden_size] with unit L2 norm per row."""
    return F.normalize(hidden.float(), p=2.0, dim=-1)
