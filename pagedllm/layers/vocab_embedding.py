"""Vocabulary-parallel token embedding and LM head (Megatron-LM): each rank holds a contiguous
slice of the vocabulary rows."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.linear import _copy, load_narrow, loaded_shape
from pagedllm.layers.quantization import QuantizationConfig, get_linear_method
from pagedllm.layers.quantization import gguf as gguf_blocks
from pagedllm.layers.quantization.q8_0 import is_q8_0, load_q8_0


class VocabParallelEmbedding(nn.Module):
    """Token ids [N] (int64) -> embeddings [N, hidden]. The vocabulary is padded to a multiple of
    tp_size; a rank embeds the ids in its slice, zeroes the rest, and the ranks all-reduce.

    A GGUF table kept in its ggml blocks (``models.gguf.GGUFBlocks``, one rank) stays so: the lookup
    dequantizes only the looked-up rows (``gguf.embed_rows``), the float table is released, and a
    tied LM head multiplies the same blocks (``gguf.tied_head_blocks``)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // self.tp_size) * self.tp_size
        self.shard = self.padded_vocab // self.tp_size
        self.vocab_start = self.tp_rank * self.shard
        self.vocab_end = min(self.vocab_start + self.shard, vocab_size)
        # empty, not zeros: pages never written stay unmapped (a table kept in GGUF blocks, or a tied
        # head's own table, replaced before loading, would otherwise be resident at start-up); the
        # padding rows past the vocabulary are zeroed
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.data[max(0, self.vocab_end - self.vocab_start):].zero_()
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = max(0, self.vocab_end - self.vocab_start)
        got = loaded.raw.shape[0] if gguf_blocks.is_blocks(loaded) else loaded_shape(loaded)[0]
        if got != self.vocab_size:
            raise ValueError(f"embedding has {got} rows, config says vocab_size={self.vocab_size}")
        if gguf_blocks.is_blocks(loaded):
            if param is self.weight and self.tp_size == 1 and loaded.cols == param.shape[1]:
                gguf_blocks.keep_embedding_blocks(self, loaded)
                return
            loaded = loaded.dequantize()
        _copy(param, param.data.narrow(0, 0, rows), load_narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        blocks = getattr(self, "gguf_embedding", None)
        if blocks is not None:
            return gguf_blocks.embed_rows(blocks, input_ids).to(self.embed_dtype)
        if self.tp_size == 1:
            out = F.embedding(input_ids, self.weight)
            dtype = getattr(self, "embed_dtype", None)  # a table kept narrower (gguf.requantize_tied_head)
            return out if dtype is None else out.to(dtype)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states [M, hidden] -> logits [M, vocab_size] (gathered from every rank's slice).
    The matmul is its linear method's (``layers/quantization``; float by default)."""

    # What the linear methods test (they cannot import this class: this module imports them): a
    # tied head keeps its plain weight, an int8 head stays on its packed panels at every row count.
    is_lm_head = True

    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__(vocab_size, hidden_size, dtype)
        self.prefix = prefix
        self.quant_method = get_linear_method(self, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if is_q8_0(loaded):  # an untied GGUF output matrix kept in its blocks (layers/quantization/gguf.py)
            return load_q8_0(self, super().weight_loader, param, loaded, shard_id)
        super().weight_loader(param, loaded, shard_id)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
