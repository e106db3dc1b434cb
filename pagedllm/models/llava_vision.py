"""LLaVA's vision side (Liu et al., 2023, "Visual Instruction Tuning"; transformers'
``modeling_llava.py``): a CLIP (or SigLIP: LLaVA-Interleave, LLaVA-OneVision's tower) vision transformer whose hidden states at ``vision_feature_layer``
(one index, or several concatenated along the hidden size; negative counts from the last layer,
-1 the last) go, without the class token under ``vision_feature_select_strategy="default"``,
through a two-layer MLP projector (linear_1, ``projector_hidden_act``, linear_2) into the language
model's hidden size. The language model is the one ``text_config`` names (``models/checkpoint.py``).

encode: {"pixel_values": [3, H, W]} per image -> [(H/p)*(W/p) (+1 with "full"), text_hidden].
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.models.vision import VisionTower
from pagedllm.models.vit import VitEncoder


class LlavaVisionTower(VisionTower):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vc = hf_config.vision_config
        kind = getattr(vc, "model_type", "clip_vision_model")
        if kind not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"LLaVA with a {kind!r} vision tower is not supported (CLIP or SigLIP)")
        clip = kind == "clip_vision_model"  # (SigLIP: no class token, a patch bias, no pre-norm)
        n = vc.num_hidden_layers
        layers = hf_config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.keep = tuple(i if i >= 0 else n + 1 + i for i in layers)  # as indices of hidden_states
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"
        self.dtype = dtype
        self.vision_model = VitEncoder(vc, dtype, class_token=clip, patch_bias=not clip, pre_norm=clip,
                                       post_norm=False, num_layers=max(self.keep))
        text_hidden, bias = hf_config.text_config.hidden_size, getattr(hf_config, "multimodal_projector_bias", True)
        self.projector = nn.Module()
        self.projector.linear_1 = nn.Linear(vc.hidden_size * len(self.keep), text_hidden, bias=bias, dtype=dtype)
        self.projector.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = get_act_fn(hf_config.projector_hidden_act)

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.stack([it["pixel_values"] for it in items])
        feats = self.vision_model(pixels, keep=self.keep)
        if self.drop_cls:
            feats = [f[:, 1:] for f in feats]
        x = torch.cat(feats, dim=-1)
        x = self.projector.linear_2(self.act(self.projector.linear_1(x)))
        return list(x.to(self.dtype))
