"""Linear layers sharded for tensor parallelism (Megatron-LM, Shoeybi et al., 2019).

Column-parallel layers split the output features over ranks (no communication); row-parallel
layers split the input features and all-reduce their partial outputs. Each parameter carries a
``weight_loader(param, loaded, shard_id=None)`` that copies only this rank's slice; ``loaded``
is a tensor or a lazy safetensors slice, so a rank reads just its part of the file.

How a layer stores and multiplies its weight is its *linear method*, chosen by a quantization
config (``layers/quantization``): float by default, ``Int8LinearMethod`` under ``--quantization
int8``. Every constructor takes optional ``quant_config`` and ``prefix`` (the layer's module path).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.layers.quantization import QuantizationConfig, get_linear_method
from pagedllm.layers.quantization.q8_0 import is_q8_0, load_q8_0


def loaded_shape(loaded: Any) -> list[int]:
    return list(loaded.shape) if isinstance(loaded, torch.Tensor) else list(loaded.get_shape())


def load_narrow(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Read ``loaded[start:start+size]`` along ``dim`` (0 or 1) from a tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return loaded[index]


def load_full(loaded: Any) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:] if loaded.get_shape() else loaded[()]  # (a 0-d slice cannot be sliced)


def _copy(param: torch.Tensor, target: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(src.shape):
        raise ValueError(f"weight shape mismatch: expected {tuple(target.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        target.copy_(src.to(param.dtype))


class LinearBase(nn.Module):
    """y = x W^T (+ b); the checkpoint's ``weight`` is [out_features_per_rank, in_features_per_rank]
    (what the layer holds after loading is up to its ``quant_method``)."""

    input_is_parallel = False

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size, self.output_size = in_features, out_features  # per rank
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.prefix = prefix
        self.quant_method = get_linear_method(self, quant_config, prefix)
        self.quant_method.create_weights(self, in_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__(in_features, out_features, bias, dtype, quant_config, prefix)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if is_q8_0(loaded):  # GGUF Q8_0 kept quantized (layers/quantization/q8_0.py)
            return load_q8_0(self, self.weight_loader, param, loaded, shard_id)
        _copy(param, param.data, load_full(loaded))


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over ranks. Input [*, in]; output [*, out / tp_size]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        tp = get_tp_size()
        if out_features % tp:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {tp}")
        super().__init__(in_features, out_features // tp, bias, dtype, quant_config, prefix)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if is_q8_0(loaded):  # GGUF Q8_0 kept quantized (layers/quantization/q8_0.py)
            return load_q8_0(self, self.weight_loader, param, loaded, shard_id)
        size = param.shape[0]
        _copy(param, param.data, load_narrow(loaded, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused in one matmul (e.g. gate_proj and up_proj);
    ``shard_id`` is the index of the fused part being loaded."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=torch.float32,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        tp = get_tp_size()
        for s in output_sizes:
            if s % tp:
                raise ValueError(f"output size {s} is not divisible by tensor_parallel_size {tp}")
        self.output_sizes = [s // tp for s in output_sizes]
        super().__init__(in_features, sum(self.output_sizes), bias, dtype, quant_config, prefix)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        if is_q8_0(loaded):  # GGUF Q8_0 kept quantized (layers/quantization/q8_0.py)
            return load_q8_0(self, self.weight_loader, param, loaded, shard_id)
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        _copy(param, param.data.narrow(0, offset, size), load_narrow(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection split by attention heads. When tp_size exceeds the number of KV
    heads, each KV head is replicated on tp_size / num_kv_heads ranks (as vLLM does)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, dtype=torch.float32, quant_config: Optional[QuantizationConfig] = None,
                 prefix: str = "") -> None:
        tp = get_tp_size()
        if total_num_heads % tp:
            raise ValueError(f"number of attention heads ({total_num_heads}) must be divisible by "
                             f"tensor_parallel_size ({tp})")
        if total_num_kv_heads >= tp and total_num_kv_heads % tp:
            raise ValueError(f"number of KV heads ({total_num_kv_heads}) must be divisible by "
                             f"tensor_parallel_size ({tp})")
        if total_num_kv_heads < tp and tp % total_num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of the number of KV heads "
                             f"({total_num_kv_heads}) when it exceeds it")
        self.head_dim = head_dim
        self.num_heads = total_num_heads // tp
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        self.num_kv_replicas = max(1, tp // total_num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype, quant_config, prefix)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's output [N, q_size + 2 * kv_size] -> q [N, num_heads, head_dim] and k, v
        [N, num_kv_heads, head_dim] of this rank: views of ``qkv`` (v reshaped, as its split may
        not be viewable)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str = "q") -> None:
        if is_q8_0(loaded):  # GGUF Q8_0 kept quantized (layers/quantization/q8_0.py)
            return load_q8_0(self, self.weight_loader, param, loaded, shard_id)
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            start = (self.tp_rank // self.num_kv_replicas) * self.kv_size
        _copy(param, param.data.narrow(0, offset, size), load_narrow(loaded, 0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are all-reduced. Input [*, in / tp_size];
    output [*, out]. The bias is added once, after the reduction."""

    input_is_parallel = True  # read by quant methods: x holds a slice of each row's features

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32,
                 reduce_results: bool = True, quant_config: Optional[QuantizationConfig] = None,
                 prefix: str = "") -> None:
        tp = get_tp_size()
        if in_features % tp:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {tp}")
        super().__init__(in_features // tp, out_features, bias, dtype, quant_config, prefix)
        self.reduce_results = reduce_results
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if is_q8_0(loaded):  # GGUF Q8_0 kept quantized (layers/quantization/q8_0.py)
            return load_q8_0(self, self.weight_loader, param, loaded, shard_id)
        size = param.shape[1]
        _copy(param, param.data, load_narrow(loaded, 1, self.tp_rank * size, size))

    def _bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _copy(param, param.data, load_full(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        return self.quant_method.apply_row_parallel(self, x, self.bias, self.reduce_results)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Optional[Any] = None) -> None:
    """Copy a whole (replicated) weight."""
    _copy(param, param.data, load_full(loaded))
