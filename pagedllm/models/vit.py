"""The pre-norm Vision Transformer encoder that CLIP (LLaVA's tower) and SigLIP (Gemma 3's) share:
a patch convolution, learned position embeddings, then layers of LayerNorm -> bidirectional
multi-head attention -> residual, LayerNorm -> MLP (fc1, activation, fc2) -> residual.

References: Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
Supervision" (CLIP); Zhai et al., 2023, "Sigmoid Loss for Language Image Pre-Training" (SigLIP);
transformers' ``modeling_clip.py`` / ``modeling_siglip.py`` (the checkpoint names below are theirs).
Images are few and small next to a prompt's tokens, so this runs plain PyTorch (SDPA) on one rank:
no tensor parallelism, no paged cache.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import get_act_fn


class VitAttention(nn.Module):
    """x [B, T, D] -> [B, T, D]: every token attends to every token of its image."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.k_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.v_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class VitLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.self_attn = VitAttention(d, cfg.num_attention_heads, dtype)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, cfg.intermediate_size, dtype=dtype)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, d, dtype=dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VitEmbeddings(nn.Module):
    """pixel_values [B, 3, H, W] -> [B, (1 +) (H/p)*(W/p), D]: patches (row-major), with CLIP's class
    token first when ``class_token``, plus the learned position embedding."""

    def __init__(self, cfg: Any, dtype: torch.dtype, class_token: bool, patch_bias: bool) -> None:
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, p, stride=p, bias=patch_bias, dtype=dtype)
        n = (cfg.image_size // p) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype)) if class_token else None
        self.position_embedding = nn.Embedding(n, d, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight[:x.shape[1]]


class VitEncoder(nn.Module):
    """CLIP's (``class_token``, ``pre_norm``) or SigLIP's (``post_norm``) vision transformer, under
    transformers' names (``embeddings.*``, ``pre_layrnorm``, ``encoder.layers.{i}.*``, ``post_layernorm``).
    ``num_layers`` builds only the first layers (a tower whose features come from an earlier layer)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, *, class_token: bool, patch_bias: bool, pre_norm: bool,
                 post_norm: bool, num_layers: int) -> None:
        super().__init__()
        self.embeddings = VitEmbeddings(cfg, dtype, class_token, patch_bias)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype) if pre_norm else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([VitLayer(cfg, dtype) for _ in range(num_layers)])
        self.post_layernorm = (nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
                               if post_norm else None)

    def forward(self, pixel_values: torch.Tensor, keep: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """[B, 3, H, W] -> the hidden states after each layer count in ``keep`` (0: the embeddings'
        output; as transformers' ``hidden_states[i]``) [B, T, D] each, or, with ``keep`` empty, the last
        layer's output (through ``post_layernorm`` where there is one) as a one-item list."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        kept = {0: x} if 0 in keep else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in keep:
                kept[i] = x
        if keep:
            return [kept[i] for i in keep]
        return [self.post_layernorm(x) if self.post_layernorm is not None else x]
