"""Learned absolute position embeddings (GPT-2, OPT): a table replicated on every rank, looked up
at each token's position. OPT's table has 2 extra leading rows (``offset=2``, a fairseq legacy of
its padding index), so position p reads row p + 2."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LearnedPositionEmbedding(nn.Module):
    """positions [N] (int64) -> embeddings [N, dim]; ``weight`` is [num_positions + offset, dim]."""

    def __init__(self, num_positions: int, dim: int, dtype=torch.float32, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(num_positions + offset, dim, dtype=dtype), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
