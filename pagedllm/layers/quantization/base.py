"""Quantization as a linear method (after vLLM's ``quantization/base_config.py``).

A linear layer does not create or multiply its own weights: it asks a ``QuantizationConfig`` for a
``LinearMethodBase`` (``get_quant_method(layer, prefix)``), and that method

1. ``create_weights``: registers the parameters the checkpoint is loaded into (their
   ``weight_loader`` is then attached by the layer, which knows its tensor-parallel slice);
2. ``process_weights_after_loading``: turns loaded weights into what ``apply`` needs (for int8:
   quantize per output channel and drop the float copy);
3. ``apply``: ``y = x W^T (+ b)`` for input ``[*, in_features_per_rank]``.

"unquantized" is one method (``unquantized.py``), int8 another (``int8.py``). A config sees the
layer's name prefix (``"layers.3.mlp.down_proj"``, ``"lm_head"``) and may return the unquantized
method for layers it skips.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce


class LinearMethodBase(ABC):
    """How one linear layer stores and multiplies its weight."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype) -> None:
        """Register ``layer.weight`` (and ``layer.bias``, None when ``bias`` is False) for a
        checkpoint of ``[output_size, input_size]`` (sizes per rank) in ``dtype``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every weight is loaded (and before the first forward)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [*, in] -> ``x W^T + bias`` [*, out] in ``x.dtype``."""

    def apply_row_parallel(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                           reduce_results: bool) -> torch.Tensor:
        """Row-parallel matmul (``x`` holds this rank's slice of the input features): the
        partial products are summed over ranks when ``reduce_results``, and the bias is added once,
        after the sum; otherwise the caller sums them (e.g. an MoE block) and rank 0 adds the bias."""
        if not reduce_results:
            return self.apply(layer, x, bias if layer.tp_rank == 0 else None)
        out = tensor_model_parallel_all_reduce(self.apply(layer, x))
        return out + bias if bias is not None else out


class QuantizationConfig(ABC):
    """Chooses each linear layer's method. ``name`` is what ``--quantization`` takes."""

    name: str = ""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        """The method for ``layer`` named ``prefix`` (module path in the model, "" when unknown);
        None leaves the layer unquantized."""

    def describe(self) -> str:
        return self.name
