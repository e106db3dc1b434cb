"""What the engine hands a model-runner rank for one forward pass (built by ``engine/input_batch.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.lora.slots import LoRABatch
from pagedllm.multimodal.encoder_cache import MultiModalStep


@dataclass
class ModelInput:
    """Everything a model-runner rank needs for one forward pass (picklable).

    ``input_ids``/``positions`` [N] int64 (``positions`` [3, N] in a step that prefills an M-RoPE
    prompt's image positions: ``engine/input_batch.py``); ``logits_indices`` [M] int64 rows of the hidden states
    whose logits are computed: first one per sampling request, then prompt-logprob positions.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    # ``logits_indices`` is every row in order (0 .. N - 1: a decode-only step): the runner computes the
    # logits of the hidden states as they are, without gathering a copy of them.
    logits_all_rows: bool = False
    # Copy-on-write block copies (src, dst) to do before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Under --enable-lora: each token's adapter slot and the adapters the slots must hold (None: base only).
    lora: Optional[LoRABatch] = None
    # Images in this step (multimodal/encoder_cache.py): what to encode or drop, and where their
    # embedding rows replace the placeholder tokens' embeddings (None: no image token in the step).
    mm: Optional[MultiModalStep] = None
    # Speculative decoding's mtp method: the runner returns (logits, hidden states [N, hidden] of every
    # token after the final norm), the MTP layer's input at the next step (``spec_decode/mtp.py``).
    return_hidden: bool = False
