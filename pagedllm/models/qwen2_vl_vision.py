"""Qwen2-VL's and Qwen2.5-VL's vision transformer (ViT) and patch merger: pixel patches -> image
embeddings in the language model's hidden size.

Reference: Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at
Any Resolution"; Bai et al., 2025, "Qwen2.5-VL Technical Report"; transformers' ``modeling_qwen2_vl.py``
and ``modeling_qwen2_5_vl.py`` (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2_5_VisionTransformerPretrainedModel``), whose fp32 outputs these modules match (allclose).

The image processor (transformers' ``Qwen2VLImageProcessor``) cuts an image resized to multiples of
``patch_size * spatial_merge_size`` into patches of [C, temporal_patch_size, p, p] values (a still
image repeats its frame twice), listed merge-block by merge-block: the m x m patches that the merger
fuses into one language-model token are consecutive. ``grid_thw`` [n_images, 3] gives each image's
(t, h, w) in patches.

- Patch embedding: a Conv3d whose kernel equals its stride, i.e. one linear map of each flattened
  patch (the checkpoint's [E, C, T, p, p] weight is read as [E, C*T*p*p]).
- 2D rotary embedding in every block: the first half of each head's rotary frequencies turn with
  the patch's row, the second with its column (transformers' ``Qwen2VLVisionRotaryEmbedding``).
- Attention never crosses an image (or a video frame). Qwen2.5-VL attends within windows of
  ``window_size`` pixels (``vit_merger_window_size`` merged tokens a side) except in the blocks of
  ``fullatt_block_indexes``; its tokens are permuted window by window before the blocks and the
  merger's output permuted back.
- Qwen2-VL: LayerNorm, fc1 -> QuickGELU -> fc2 MLP (``mlp_ratio``); Qwen2.5-VL: RMSNorm, SwiGLU MLP
  with biases (``intermediate_size``).
- Patch merger: norm (LayerNorm / RMSNorm) of each patch, m*m neighbours concatenated,
  Linear -> GELU -> Linear to the language model's hidden size.

The tower is replicated on every tensor-parallel rank (``ReplicatedLinear``): it is small next to
the language model and runs once per image (the encoder cache keeps its output).

``Qwen2VLVisionTower`` is the engine's interface to it (``models/vision.py``): the prompt side uses
transformers' ``Qwen2VLImageProcessorPil`` directly (its ``Qwen2VLProcessor`` insists on a torchvision
video processor) and expands each ``<|image_pad|>`` to the image's t*h*w / merge^2 tokens as that
processor does; the language model (``models/qwen2.py``) takes the prompt's M-RoPE positions
(``layers/mrope.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.layernorm import LayerNorm, RMSNorm
from pagedllm.layers.linear import ReplicatedLinear, load_full
from pagedllm.layers.mrope import mrope_input_positions
from pagedllm.models.image_prompt import ImagePromptProcessor, OwnPromptProcessor
from pagedllm.models.vision import VisionTower, load_module_weights, strip_prefix
from pagedllm.platforms import ops

_VISUAL = ("model.visual.", "visual.")


def is_qwen2_5(vision_config: Any) -> bool:
    """True for Qwen2.5-VL's vision config (window attention, RMSNorm, SwiGLU), False for Qwen2-VL's."""
    return getattr(vision_config, "fullatt_block_indexes", None) is not None


def vision_rotary_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[P, 2] int64: each patch's (row, column) in its image, patches listed merge-block by merge-block
    (the processor's order), each frame repeating its image's (transformers' ``get_vision_position_ids``)."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block row, row in block, block col, col in block) -> (block row, block col, row, col)
        hw = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def window_index(grid_thw: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (order [P / merge^2] int64, the merged tokens listed window by window, each
    image's windows row-major; window lengths in patches, empty windows dropped). ``window``: merged
    tokens per window side (``window_size // spatial_merge_size // patch_size``). Transformers'
    ``get_vision_window_index``."""
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        nh, nw = -(-gh // window), -(-gw // window)  # windows a side (the last one may be partial)
        for f in range(t):
            for wy in range(nh):
                for wx in range(nw):
                    cell = idx[f, wy * window:(wy + 1) * window, wx * window:(wx + 1) * window].reshape(-1)
                    if cell.numel():
                        order.append(cell + base)
                        lengths.append(cell.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), lengths


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of ``lengths`` tokens (images, frames or
    windows). q, k, v [S, H, D] -> [S, H * D]. Segments of one length run as one batched call."""
    s, h, d = q.shape
    out = torch.empty(s, h, d, dtype=q.dtype, device=q.device)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(starts[i])
    for n, firsts in by_len.items():
        idx = (torch.tensor(firsts, device=q.device).view(-1, 1) + torch.arange(n, device=q.device)).view(-1)
        qs, ks, vs = (x.index_select(0, idx).view(len(firsts), n, h, d).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [B, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, h, d))
    return out.view(s, h * d)


class Qwen2VisionAttention(nn.Module):
    """x [S, E] -> [S, E]: fused qkv (with bias), 2D RoPE in float32, attention within segments, proj."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True, dtype=dtype)
        self.proj = ReplicatedLinear(dim, dim, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        # transformers rotates in float32 and casts back
        q, k = (ops.rotary_(t.float().contiguous(), cos_sin).to(x.dtype) for t in (q, k))
        return self.proj(segment_attention(q, k, v, lengths, self.head_dim ** -0.5))


class Qwen2VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1(x))), ``hidden_act`` quick_gelu."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, hidden, bias=True, dtype=dtype)
        self.fc2 = ReplicatedLinear(hidden, dim, bias=True, dtype=dtype)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Qwen2.5-VL's (with biases, ``hidden_act`` silu) and Pixtral's (without)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(dim, hidden, bias=bias, dtype=dtype)
        self.up_proj = ReplicatedLinear(dim, hidden, bias=bias, dtype=dtype)
        self.down_proj = ReplicatedLinear(hidden, dim, bias=bias, dtype=dtype)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if is_qwen2_5(config):
            dim = config.hidden_size
            self.norm1, self.norm2 = RMSNorm(dim, 1e-6, dtype), RMSNorm(dim, 1e-6, dtype)
            self.mlp = GatedVisionMLP(dim, config.intermediate_size, config.hidden_act, dtype)
        else:
            dim = config.embed_dim
            self.norm1, self.norm2 = LayerNorm(dim, 1e-6, dtype), LayerNorm(dim, 1e-6, dtype)
            self.mlp = Qwen2VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act, dtype)
        self.attn = Qwen2VisionAttention(dim, config.num_heads, dtype)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, lengths)
        return x + self.mlp(self.norm2(x))


class Qwen2VisionPatchMerger(nn.Module):
    """[P, E] -> [P / m^2, out]: ln_q per patch, m*m consecutive patches concatenated, mlp.0 -> GELU -> mlp.2
    (the checkpoint's ``merger.mlp.0`` / ``merger.mlp.2`` names)."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6, dtype) if rms else LayerNorm(dim, 1e-6, dtype)
        self.mlp = nn.ModuleList([ReplicatedLinear(self.hidden, self.hidden, bias=True, dtype=dtype), nn.GELU(),
                                  ReplicatedLinear(self.hidden, out_dim, bias=True, dtype=dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.hidden)
        return self.mlp[2](self.mlp[1](self.mlp[0](x)))


class Qwen2VisionTransformer(nn.Module):
    """forward(pixel_values [P, C * T * p * p], grid_thw [n, 3] int64) -> [sum(t*h*w) / m^2, out_hidden]:
    the image embeddings, images one after the other (``split_sizes(grid_thw)`` rows each).

    ``vision_config``: a ``Qwen2VLVisionConfig`` or ``Qwen2_5_VLVisionConfig``; ``dtype`` of the weights
    (pixel values are cast to it). ``load_weights`` takes the checkpoint's ``visual.``/``model.visual.``
    tensors (other names are skipped)."""

    def __init__(self, vision_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        self.config, self.dtype = cfg, dtype
        self.qwen2_5 = is_qwen2_5(cfg)
        dim = cfg.hidden_size if self.qwen2_5 else cfg.embed_dim
        out_dim = cfg.out_hidden_size if self.qwen2_5 else cfg.hidden_size
        self.merge, self.patch_size = cfg.spatial_merge_size, cfg.patch_size
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = ReplicatedLinear(patch_dim, dim, bias=False, dtype=dtype)
        self.blocks = nn.ModuleList([Qwen2VisionBlock(cfg, dtype) for _ in range(cfg.depth)])
        self.merger = Qwen2VisionPatchMerger(out_dim, dim, self.merge, self.qwen2_5, dtype)
        head_dim = dim // cfg.num_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        quarter = head_dim // 2  # frequencies over half the head, for rows and columns each
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)
        self.fullatt = set(getattr(cfg, "fullatt_block_indexes", None) or [])
        self.window = cfg.window_size // self.merge // self.patch_size if self.qwen2_5 else 0

    def split_sizes(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows of each image: t * h * w / merge^2."""
        return (grid_thw.prod(-1) // self.merge ** 2).tolist()

    def rotary_cos_sin(self, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, 2, 1, head_dim] float32: cos and sign-folded sin (``ops.rotary_``'s layout) of each patch."""
        freqs = vision_rotary_positions(grid, self.merge).to(self.inv_freq.device, torch.float)[..., None] \
            * self.inv_freq  # [P, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # [rows' | columns'] frequencies
        cos, sin = freqs.cos(), freqs.sin()
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1).unsqueeze(2)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = self.patch_embed.proj(pixel_values.to(self.dtype))
        cos_sin = self.rotary_cos_sin(grid).to(x.device)
        full_lengths = [h * w for t, h, w in grid for _ in range(t)]  # attention per frame
        order: Optional[torch.Tensor] = None
        window_lengths = full_lengths
        if self.qwen2_5:
            order, window_lengths = window_index(grid, self.merge, self.window)
            order = order.to(x.device)
            unit = self.merge * self.merge
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
            cos_sin = cos_sin.view(-1, unit, *cos_sin.shape[1:])[order].reshape(cos_sin.shape)
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, full_lengths if (not self.qwen2_5 or i in self.fullatt) else window_lengths)
        x = self.merger(x)
        if order is not None:
            x = x[torch.argsort(order)]
        return x

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load the checkpoint's vision tensors (names under ``visual.`` or ``model.visual.``; others are
        skipped). Raises ValueError on a shape mismatch or a missing weight."""
        own = []
        for name, w in weights:
            name = strip_prefix(name, _VISUAL)
            if name == "patch_embed.proj.weight":  # Conv3d [E, C, T, p, p] -> Linear [E, C*T*p*p]
                w = load_full(w).flatten(1)
            if name is not None:
                own.append((name, w))
        load_module_weights(self, own, "Qwen2-VL vision tower")


class Qwen2VLPromptProcessor(ImagePromptProcessor):
    """The image half of transformers' ``Qwen2VLProcessor`` (``models/image_prompt.py``): "pixel_values"
    [sum of patches, C*T*p*p], "image_grid_thw" [n, 3], each ``<|image_pad|>`` repeated t*h*w / merge^2
    times for its image (``Qwen2VLProcessor.replace_image_token``)."""

    image_token = "<|image_pad|>"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    image_processor_cls = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"

    def expansion(self, processed: dict[str, torch.Tensor], i: int) -> str:
        return self.image_token * int(processed["image_grid_thw"][i].prod() // self.image_processor.merge_size ** 2)


class Qwen2VLVisionTower(OwnPromptProcessor, VisionTower):
    """Qwen2-VL's / Qwen2.5-VL's vision side for the engine (``models/vision.py``'s interface).

    Items: {"pixel_values": [t*h*w, C*T*p*p], "image_grid_thw": [3] int64} per image; ``encode`` ->
    [t*h*w / merge^2, text hidden] per image (images of one shape run as one tower call)."""

    prompt_processor = Qwen2VLPromptProcessor

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.visual = Qwen2VisionTransformer(hf_config.vision_config, dtype)

    # ---- API server side ------------------------------------------------------------------------
    @classmethod
    def split_items(cls, processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        """The patches of all images [sum of t*h*w, D] cut by ``image_grid_thw``, each with its grid [3]."""
        grid = processed["image_grid_thw"]
        if grid.shape[0] != num_images:
            raise ValueError(f"the image processor returned {grid.shape[0]} grids for {num_images} images")
        patches = torch.split(processed["pixel_values"], grid.prod(-1).tolist())
        return [{"pixel_values": p, "image_grid_thw": g} for p, g in zip(patches, grid)]

    @classmethod
    def mrope_positions(cls, hf_config: Any, input_ids: list[int], items: list[dict[str, torch.Tensor]]
                        ) -> Optional[tuple[torch.Tensor, int]]:
        """The prompt's M-RoPE positions [3, L] and delta (``layers/mrope.py``)."""
        return mrope_input_positions(input_ids, cls.image_token_id(hf_config),
                                     [it["image_grid_thw"].tolist() for it in items],
                                     hf_config.vision_config.spatial_merge_size)

    # ---- model runner side ----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.visual.load_weights(weights)

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        grid = torch.stack([it["image_grid_thw"] for it in items]).to(torch.int64)
        x = self.visual(torch.cat([it["pixel_values"] for it in items]), grid)
        return list(torch.split(x.to(self.dtype), self.visual.split_sizes(grid)))
