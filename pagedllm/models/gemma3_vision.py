"""Gemma 3's vision side (Gemma Team, 2025, "Gemma 3 Technical Report"; transformers'
``modeling_gemma3.py``: ``Gemma3MultiModalProjector``): a SigLIP vision transformer (its last layer,
post-LayerNorm, no pooling head), whose patch grid is average-pooled to ``mm_tokens_per_image``
tokens (e.g. 64x64 patches -> 16x16), RMS-normalized (Gemma's (1 + w) weight, in float32) and
projected by ``mm_input_projection_weight`` [vision_hidden, text_hidden] into the text model's space.
The embeddings replace the image tokens unscaled (the text embeddings around them keep Gemma's
sqrt(hidden) scale). Pan-and-scan crops are off unless the processor's config turns them on (each
crop is then one more image of ``mm_tokens_per_image`` tokens, as transformers' processor writes it).

encode: {"pixel_values": [3, S, S]} per image -> [mm_tokens_per_image, text_hidden].
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.vision import VisionTower
from pagedllm.models.vit import VitEncoder


class Gemma3VisionTower(VisionTower):
    bidirectional_image_attention = True  # an image's soft tokens see each other (token_type_ids)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vc = hf_config.vision_config
        if getattr(vc, "model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {vc.model_type!r} vision tower is not supported (SigLIP only)")
        self.dtype = dtype
        self.vision_model = VitEncoder(vc, dtype, class_token=False, patch_bias=True, pre_norm=False,
                                       post_norm=True, num_layers=vc.num_hidden_layers)
        self.patches_per_side = vc.image_size // vc.patch_size
        tokens_per_side = int(hf_config.mm_tokens_per_image ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = vc.layer_norm_eps
        self.projector = nn.Module()
        self.projector.mm_input_projection_weight = nn.Parameter(
            torch.empty(vc.hidden_size, hf_config.text_config.hidden_size, dtype=dtype))
        self.projector.mm_soft_emb_norm = nn.Module()
        self.projector.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vc.hidden_size, dtype=dtype))

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.stack([it["pixel_values"] for it in items])
        x = self.vision_model(pixels)[0]  # [B, P*P, D]
        b, _, d = x.shape
        p = self.patches_per_side
        x = F.avg_pool2d(x.transpose(1, 2).reshape(b, d, p, p), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (xf * (1.0 + self.projector.mm_soft_emb_norm.weight.float())).type_as(x)
        x = torch.matmul(x, self.projector.mm_input_projection_weight)
        return list(x.to(self.dtype))
