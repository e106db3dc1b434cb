"""Quantization methods by name (``--quantization``), and the post-load step of the loader.

    QUANTIZATION_METHODS: name -> QuantizationConfig factory ("int8", "int8-g64")
    get_quantization_config(name) -> config, or None for None / "none"
    process_weights_after_loading(model, config): bind each layer's method to its name, then let
        every method fix up its weights; returns a QuantizationReport.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.int8 import Int8Config, Int8LinearMethod
from pagedllm.layers.quantization import gguf, q8_0
from pagedllm.layers.quantization.smoothquant import DEFAULT_SMOOTH_ALPHA
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

QUANTIZATION_METHODS: dict[str, Callable[[], QuantizationConfig]] = {
    "int8": partial(Int8Config, smooth_alpha=DEFAULT_SMOOTH_ALPHA),  # one activation scale per token, SmoothQuant
    "int8-g64": partial(Int8Config, act_group_size=64),  # per token and per group of 64 features
}


def get_quantization_config(name: Optional[str]) -> Optional[QuantizationConfig]:
    """Config for ``name`` (None or "none": no quantization). Raises ValueError for an unknown name."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)} (or none); got {name!r}")
    return QUANTIZATION_METHODS[name]()


def get_linear_method(layer: nn.Module, quant_config: Optional[QuantizationConfig], prefix: str) -> LinearMethodBase:
    method = quant_config.get_quant_method(layer, prefix) if quant_config is not None else None
    return method if method is not None else UnquantizedLinearMethod()


def _param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters (each storage once) and of GGUF blocks the layers keep."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total + sum(getattr(m, "gguf_bytes", 0) for m in model.modules())


@dataclass
class QuantizationReport:
    method: str
    num_quantized: int  # layers whose method is not the float one
    bytes_before: int  # this rank's parameter bytes before / after the post-load step
    bytes_after: int
    smoothing: str = ""  # what SmoothQuant did before quantizing ("": nothing)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after


def process_weights_after_loading(model: nn.Module, quant_config: Optional[QuantizationConfig]) -> QuantizationReport:
    """Run once after the checkpoint is loaded. A layer built without a ``prefix`` (our models do
    not pass one) gets its module path as prefix, and its method is chosen again by ``quant_config``
    from that name (so a config can skip e.g. "lm_head"); methods chosen here must load the same
    float weights as the float method does (int8 does). Then every method processes its weights."""
    before = _param_bytes(model)
    count = 0
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), LinearMethodBase):
            continue
        if quant_config is not None and not getattr(module, "prefix", ""):
            module.prefix = name
            module.quant_method = get_linear_method(module, quant_config, name)
        if getattr(module, "q8_0_qs", None) is not None:  # GGUF Q8_0 blocks kept by the loader
            # straight into an int8 layer's weights where every row came from Q8_0 (its method
            # then skips quantizing), else into the float weight (which an int8 method quantizes)
            q8_0.finish_q8_0(module, to_int8=isinstance(module.quant_method, Int8LinearMethod))
        if getattr(module, "gguf_segments", None) is not None and getattr(module, "gguf_rows", None) is not None:
            # GGUF blocks kept by the loader (gguf.py): multiplied as stored where the layer is float
            # and all its rows came so, else dequantized into the float weight
            gguf.finish_blocks(module, keep_blocks=isinstance(module.quant_method, UnquantizedLinearMethod))
        if getattr(getattr(module, "weight", None), "gguf_blocks", None) is not None:
            # an LM head tied to an embedding kept in GGUF blocks: it multiplies the same blocks
            gguf.tied_head_blocks(module, keep_blocks=isinstance(module.quant_method, UnquantizedLinearMethod))
        module.quant_method.process_weights_after_loading(module)
        count += not isinstance(module.quant_method, UnquantizedLinearMethod)
    return QuantizationReport(quant_config.describe() if quant_config else "none", count, before, _param_bytes(model))


__all__ = ["QUANTIZATION_METHODS", "Int8Config", "Int8LinearMethod", "LinearMethodBase", "QuantizationConfig",
           "QuantizationReport", "UnquantizedLinearMethod", "get_linear_method", "get_quantization_config",
           "process_weights_after_loading"]
