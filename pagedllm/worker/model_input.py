"""What the engine hands a model-runner rank for one forward pass (built by ``engine/input_batch.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.layers.attention import AttentionMetadata


@dataclass
class ModelInput:
    """Everything a model-runner rank needs for one forward pass (picklable).

    ``input_ids``/``positions`` [N] int64; ``logits_indices`` [M] int64 rows of the hidden states
    whose logits are computed: first one per sampling request, then prompt-logprob positions.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    # Copy-on-write block copies (src, dst) to do before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
