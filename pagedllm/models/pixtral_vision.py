"""Mistral 3's vision side (Mistral Small 3.1/3.2, Ministral 3): the Pixtral vision encoder, then a
projector that merges m x m neighbouring patches (Mistral AI, 2024, "Pixtral 12B"; transformers'
``modeling_pixtral.py`` ``PixtralVisionModel`` and ``modeling_mistral3.py``
``Mistral3MultiModalProjector``, whose fp32 outputs these modules match, allclose).

- Encoder: each image at its own size (a multiple of patch_size * spatial_merge_size, longest edge
  at most ``size["longest_edge"]``), patches of p x p pixels embedded by a bias-free Conv2d (a linear
  map of each flattened [C, p, p] patch), RMSNorm (``ln_pre``), then pre-RMSNorm blocks: attention
  (bias-free q/k/v/o) with 2D RoPE (the even-indexed rotary frequencies turn with the patch's row, the
  odd-indexed ones with its column: ``PixtralVisionRotaryEmbedding``) within the image only, and a
  SwiGLU MLP (``hidden_act``).
- Projector: RMSNorm (the text model's eps), the patch merger (each m x m block of patches, features
  ordered (channel, row in block, column in block) as ``torch.nn.functional.unfold`` lays them out,
  through a bias-free Linear to the vision hidden size), linear_1 -> ``projector_hidden_act`` -> linear_2
  into the language model's hidden size.
- Prompt: each image is ``[IMG]`` x columns then ``[IMG_BREAK]``, per row of merged patches, the last
  ``[IMG_BREAK]`` replaced by ``[IMG_END]`` (``PixtralProcessor.replace_image_token``); only the ``[IMG]``
  tokens take embedding rows (``is_embed``), the break and end tokens keep their text embeddings.

transformers' ``PixtralProcessor`` requires torchvision, so the prompt side runs its PIL image
processor (``PixtralImageProcessorPil``) and expands the placeholders itself. The tower is replicated
on every tensor-parallel rank and runs once per image (the encoder cache keeps its output).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ReplicatedLinear, load_full
from pagedllm.models.image_prompt import ImagePromptProcessor, OwnPromptProcessor
from pagedllm.models.qwen2_vl_vision import GatedVisionMLP, segment_attention
from pagedllm.models.vision import PROJECTOR_PREFIXES, TOWER_PREFIXES, VisionTower, load_parts
from pagedllm.platforms import ops



class PixtralAttention(nn.Module):
    """x [S, D] -> [S, D]: q/k/v (no bias), 2D RoPE, attention within each image, o_proj."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, ReplicatedLinear(dim, dim, bias=False, dtype=dtype))

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = (p(x).view(s, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        ops.rotary_(q, cos_sin)
        ops.rotary_(k, cos_sin)
        return self.o_proj(segment_attention(q, k, v, lengths, self.head_dim ** -0.5))


class PixtralBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.attention_norm, self.ffn_norm = RMSNorm(d, 1e-5, dtype), RMSNorm(d, 1e-5, dtype)
        self.attention = PixtralAttention(d, cfg.num_attention_heads, dtype)
        self.feed_forward = GatedVisionMLP(d, cfg.intermediate_size, cfg.hidden_act, dtype, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos_sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionEncoder(nn.Module):
    """forward(images: list of [C, H, W], keep) -> the hidden states ``keep`` names (indices into (ln_pre
    output, block 1, ..., block n)), each [sum of (H/p)*(W/p), D], images one after the other, patches
    row-major. Parameter names are the checkpoint's under ``vision_tower.``."""

    def __init__(self, cfg: Any, dtype: torch.dtype, num_layers: int) -> None:
        super().__init__()
        self.patch_size, self.dtype = cfg.patch_size, dtype
        d = cfg.hidden_size
        self.patch_conv = ReplicatedLinear(cfg.num_channels * cfg.patch_size ** 2, d, bias=False, dtype=dtype)
        self.ln_pre = RMSNorm(d, 1e-5, dtype)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList([PixtralBlock(cfg, dtype) for _ in range(num_layers)])
        head_dim = d // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        self.register_buffer("inv_freq", torch.cat([inv[0::2], inv[1::2]]), persistent=False)  # [rows' | cols']

    def cos_sin(self, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[P, 2, 1, head_dim] in the weights' dtype: cos and sign-folded sin at each patch (row, column)."""
        quarter = self.inv_freq.shape[0] // 2
        parts = []
        for h, w in grids:
            rows = torch.arange(h, device=self.inv_freq.device).repeat_interleave(w).float()
            cols = torch.arange(w, device=self.inv_freq.device).repeat(h).float()
            parts.append(torch.cat([rows[:, None] * self.inv_freq[:quarter],
                                    cols[:, None] * self.inv_freq[quarter:]], -1))
        f = torch.cat(parts)
        cos, sin = f.cos(), f.sin()
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1).unsqueeze(2).to(self.dtype)

    def forward(self, images: list[torch.Tensor], keep: tuple[int, ...]) -> list[torch.Tensor]:
        p = self.patch_size
        grids, patches = [], []
        for im in images:
            c, h, w = im.shape
            grids.append((h // p, w // p))
            # [C, H, W] -> [(H/p)*(W/p), C*p*p], row-major patches, each flattened (C, p, p) like the conv weight
            patches.append(im[:, :h // p * p, :w // p * p].reshape(c, h // p, p, w // p, p)
                           .permute(1, 3, 0, 2, 4).reshape(-1, c * p * p))
        x = self.ln_pre(self.patch_conv(torch.cat(patches).to(self.dtype)))
        cos_sin = self.cos_sin(grids)
        lengths = [h * w for h, w in grids]
        out = {0: x} if 0 in keep else {}
        for i, layer in enumerate(self.transformer.layers, start=1):
            x = layer(x, cos_sin, lengths)
            if i in keep:
                out[i] = x
        return [out[i] for i in keep]


class Mistral3Projector(nn.Module):
    """[h * w, D] per image -> [(h/m)*(w/m), text hidden] (``Mistral3MultiModalProjector``)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, m = hf_config.vision_config.hidden_size, hf_config.spatial_merge_size
        text, bias = hf_config.text_config.hidden_size, hf_config.multimodal_projector_bias
        self.m = m
        self.norm = RMSNorm(d, hf_config.text_config.rms_norm_eps, dtype)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = ReplicatedLinear(d * m * m, d, bias=False, dtype=dtype)
        self.linear_1 = ReplicatedLinear(d, text, bias=bias, dtype=dtype)
        self.linear_2 = ReplicatedLinear(text, text, bias=bias, dtype=dtype)
        self.act = get_act_fn(hf_config.projector_hidden_act)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        x = self.norm(x)
        m, d = self.m, x.shape[-1]
        merged = []
        for rows, (h, w) in zip(torch.split(x, [h * w for h, w in grids]), grids):
            # (h/m, m, w/m, m, d) -> (h/m, w/m, d, m, m): unfold's (channel, row, column) feature order
            merged.append(rows.view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3).reshape(-1, d * m * m))
        x = self.patch_merger.merging_layer(torch.cat(merged))
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralPromptProcessor(ImagePromptProcessor):
    """``PixtralProcessor``'s work without torchvision (``models/image_prompt.py``): "pixel_values"
    [n, C, H_max, W_max] (padded), "image_sizes" [n, 2], each ``[IMG]`` expanded to its image's rows of
    ``[IMG]`` x columns + ``[IMG_BREAK]``, the last break ``[IMG_END]`` (``replace_image_token``)."""

    image_token = placeholder = "[IMG]"
    image_processor_cls = "transformers.models.pixtral.image_processing_pil_pixtral:PixtralImageProcessorPil"

    @property
    def unit(self) -> int:
        """Pixels per merged token a side: patch_size * spatial_merge_size."""
        return self.hf_config.vision_config.patch_size * self.hf_config.spatial_merge_size

    def image_kwargs(self) -> dict:
        return {"patch_size": self.unit}  # (sizes rounded to whole merged tokens, as PixtralProcessor asks)

    def expansion(self, processed: dict[str, torch.Tensor], i: int) -> str:
        h, w = (int(v) // self.unit for v in processed["image_sizes"][i].tolist())
        return ((self.image_token * w + "[IMG_BREAK]") * h)[:-len("[IMG_BREAK]")] + "[IMG_END]"


class PixtralVisionTower(OwnPromptProcessor, VisionTower):
    """Mistral 3's vision side for the engine (``models/vision.py``'s interface).

    Items: {"pixel_values": [C, H, W] (the image's own size), "image_sizes": [2]}; ``encode`` ->
    [(H/(p*m)) * (W/(p*m)), text hidden] per image."""

    prompt_processor = PixtralPromptProcessor

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vc = hf_config.vision_config
        n, layer = vc.num_hidden_layers, hf_config.vision_feature_layer
        if not isinstance(layer, int):  # (transformers' projector norms vision_config.hidden_size features)
            raise ValueError(f"Mistral 3 with several vision_feature_layer ({layer}) is not supported (one layer)")
        self.keep = (layer if layer >= 0 else n + 1 + layer,)  # an index into (ln_pre, block 1, ..., block n)
        self.dtype = dtype
        self.vision_tower = PixtralVisionEncoder(vc, dtype, num_layers=max(self.keep))
        self.multi_modal_projector = Mistral3Projector(hf_config, dtype)

    # ---- API server side ------------------------------------------------------------------------
    @classmethod
    def split_items(cls, processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        """Each image's pixels cut out of the padded batch, with its size [2]."""
        sizes = processed["image_sizes"]
        if sizes.shape[0] != num_images:
            raise ValueError(f"the image processor returned {sizes.shape[0]} sizes for {num_images} images")
        return [{"pixel_values": px[:, :int(h), :int(w)].contiguous(), "image_sizes": s}
                for px, s, (h, w) in zip(processed["pixel_values"], sizes, sizes.tolist())]

    @classmethod
    def placeholder_ranges(cls, hf_config: Any, input_ids: list[int], items: list[dict[str, torch.Tensor]]
                           ) -> list[tuple[int, int, Optional[list[bool]]]]:
        """Each image's span from its first ``[IMG]`` to its ``[IMG_END]``: rows x (columns + 1) tokens,
        ``is_embed`` True on the ``[IMG]`` tokens. Raises ValueError when the prompt does not hold them."""
        tid = cls.image_token_id(hf_config)
        unit = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
        ranges, i = [], 0
        for k, item in enumerate(items):
            h, w = (int(v) // unit for v in item["image_sizes"].tolist())
            while i < len(input_ids) and input_ids[i] != tid:
                i += 1
            is_embed = ([True] * w + [False]) * h
            span = input_ids[i:i + len(is_embed)]
            if len(span) != len(is_embed) or any((t == tid) != e for t, e in zip(span, is_embed)):
                raise ValueError(f"image {k}'s {h} x {w} [IMG] tokens are not in the prompt at index {i}")
            ranges.append((i, len(is_embed), is_embed))
            i += len(is_embed)
        if tid in input_ids[i:]:
            raise ValueError(f"the prompt has more [IMG] tokens than its {len(items)} image(s) take")
        return ranges

    # ---- model runner side ----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's ``vision_tower.`` and ``multi_modal_projector.`` tensors (``model.``-prefixed
        in transformers 5; blocks past the feature layer skipped). Raises ValueError on a shape mismatch
        or a missing weight."""
        def conv_as_linear(pairs):  # Conv2d [D, C, p, p] -> Linear [D, C*p*p]
            for name, w in pairs:
                yield name, load_full(w).flatten(1) if name.endswith("vision_tower.patch_conv.weight") else w

        load_parts(conv_as_linear(weights), [(TOWER_PREFIXES, self.vision_tower, "Pixtral vision encoder"),
                                             (PROJECTOR_PREFIXES, self.multi_modal_projector, "Mistral 3 projector")])

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        images = [it["pixel_values"] for it in items]
        feats = self.vision_tower(images, self.keep)[0]
        p = self.vision_tower.patch_size
        grids = [(im.shape[1] // p, im.shape[2] // p) for im in images]
        x = self.multi_modal_projector(feats, grids)
        m = self.multi_modal_projector.m
        return list(torch.split(x.to(self.dtype), [h // m * (w // m) for h, w in grids]))
