"""Helpers for ``load_weights``: route one checkpoint tensor to a parameter's ``weight_loader``
and check that nothing is missing at the end."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pagedllm.layers.linear import default_weight_loader


def load_param(params: dict[str, nn.Parameter], loaded: set[str], name: str, w: Any,
               shard: Optional[Any] = None) -> bool:
    """Load ``w`` (tensor or safetensors slice) into ``params[name]`` (the part ``shard`` of a
    fused parameter when given); returns False when the model has no such parameter."""
    param = params.get(name)
    if param is None:
        return False
    loader = getattr(param, "weight_loader", default_weight_loader)
    if shard is None:
        loader(param, w)
    else:
        loader(param, w, shard)
    loaded.add(name)
    return True


def load_stacked(params: dict[str, nn.Parameter], loaded: set[str], stacked_params: list[tuple[str, str, Any]],
                 name: str, w: Any) -> bool:
    """Load one checkpoint tensor by our parameter names: the first ``(fragment, fused parameter
    fragment, shard id)`` of ``stacked_params`` whose fragment ``name`` holds routes it into that shard
    of the fused parameter (q/k/v into qkv_proj, an expert's matrices into the stacked experts), else
    it loads into ``params[name]``. False when no parameter takes it."""
    for frag, fused, shard in stacked_params:
        if f".{frag}." in name:
            return load_param(params, loaded, name.replace(frag, fused), w, shard)
    return load_param(params, loaded, name, w)


def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    """Raises ValueError naming (up to 8) parameters the checkpoint did not provide."""
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
