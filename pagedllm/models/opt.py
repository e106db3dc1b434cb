"""OPT (Zhang et al., 2022, "OPT: Open Pre-trained Transformer Language Models"): learned absolute
positions, LayerNorm, biases everywhere, multi-head attention, a ReLU MLP (transformers'
``modeling_opt.py``). GPT-2 is the same decoder with other names and Conv1D weights (``gpt2.py``).

OPT specifics: the position table has 2 leading rows no position uses (``offset=2``);
``do_layer_norm_before=False`` (OPT-350m) normalises after each residual add instead of before;
``word_embed_proj_dim != hidden_size`` (OPT-350m) adds ``project_in``/``project_out`` around the
decoder. Every layer is tensor-parallel (see ``layers/linear.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_layer_range, is_first_pp_rank, is_last_pp_rank
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.position_embedding import LearnedPositionEmbedding
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import PPMissingLayer
from pagedllm.models.weights import check_all_loaded, load_param


@dataclass
class DecoderSpec:
    """The hyperparameters OPT and GPT-2 share, read from their differently named configs."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    max_positions: int
    position_offset: int
    activation: str
    eps: float
    norm_affine: bool = True
    norm_before: bool = True
    bias: bool = True
    final_norm: bool = True
    embed_dim: int = 0  # word embedding width (OPT's word_embed_proj_dim); 0 = hidden_size
    scale_by_inverse_layer_idx: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx
    tie_word_embeddings: bool = True


class OPTAttention(nn.Module):
    """Multi-head self-attention with biases and no rotary embedding (positions are in the input)."""

    def __init__(self, spec: DecoderSpec, scale: float, dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = spec.hidden_size // spec.num_heads
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, self.head_dim, spec.num_heads, spec.num_heads,
                                          bias=spec.bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.out_proj = RowParallelLinear(spec.hidden_size, spec.hidden_size, bias=spec.bias, dtype=dtype)
        self.scale = scale
        self.backend = backend

    def forward(self, x: torch.Tensor, kv_cache: Optional[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.out_proj(o.reshape(n, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, dtype, backend: AttentionBackend) -> None:
        super().__init__()
        scale = (spec.hidden_size // spec.num_heads) ** -0.5
        if spec.scale_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.self_attn = OPTAttention(spec, scale, dtype, backend)
        self.self_attn_layer_norm = LayerNorm(spec.hidden_size, spec.eps, dtype, spec.norm_affine)
        self.fc1 = ColumnParallelLinear(spec.hidden_size, spec.ffn_dim, bias=spec.bias, dtype=dtype)
        self.fc2 = RowParallelLinear(spec.ffn_dim, spec.hidden_size, bias=spec.bias, dtype=dtype)
        self.final_layer_norm = LayerNorm(spec.hidden_size, spec.eps, dtype, spec.norm_affine)
        self.act = get_act_fn(spec.activation)
        self.norm_before = spec.norm_before

    def forward(self, x: torch.Tensor, kv_cache: Optional[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        if self.norm_before:
            x = x + self.self_attn(self.self_attn_layer_norm(x), kv_cache, meta)
            return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, meta))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class OPTForCausalLM(nn.Module):
    """forward: input_ids [N] (int64), positions [N] (int64) -> hidden states [N, embed_dim];
    compute_logits: hidden [M, embed_dim] -> logits [M, vocab_size] (float32)."""

    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        return DecoderSpec(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_layers=config.num_hidden_layers, ffn_dim=config.ffn_dim,
            max_positions=config.max_position_embeddings, position_offset=2,
            activation=config.activation_function, eps=1e-5,  # nn.LayerNorm's default, as transformers uses
            norm_affine=getattr(config, "layer_norm_elementwise_affine", True),
            norm_before=config.do_layer_norm_before, bias=getattr(config, "enable_bias", True),
            final_norm=config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False),
            embed_dim=getattr(config, "word_embed_proj_dim", None) or config.hidden_size,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True))

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """Raises ValueError when ``max_model_len`` exceeds the learned position table."""
        limit = cls.decoder_spec(config).max_positions
        if max_model_len > limit:
            raise ValueError(f"{cls.__name__} learns {limit} positions; max_model_len={max_model_len} exceeds them "
                             f"(set max_model_len <= {limit})")

    supports_pp = True  # (worker/pp_runner.py) each stage builds its layers, the first and last their ends

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__()
        self.config = config
        spec = self.spec = self.decoder_spec(config)
        backend = backend or TorchPagedAttention()
        self.start_layer, self.end_layer = get_pp_layer_range(spec.num_layers)
        first, self.last = is_first_pp_rank(), is_last_pp_rank()
        embed_dim = spec.embed_dim or spec.hidden_size
        projected = embed_dim != spec.hidden_size
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, embed_dim, dtype) if first else PPMissingLayer()
        self.embed_positions = LearnedPositionEmbedding(spec.max_positions, spec.hidden_size, dtype,
                                                        spec.position_offset) if first else PPMissingLayer()
        self.project_in = ReplicatedLinear(embed_dim, spec.hidden_size, dtype=dtype) if projected and first else None
        self.project_out = ReplicatedLinear(spec.hidden_size, embed_dim, dtype=dtype) if projected and self.last \
            else None
        self.layers = nn.ModuleList([OPTDecoderLayer(spec, i, dtype, backend)
                                     if self.start_layer <= i < self.end_layer else PPMissingLayer()
                                     for i in range(spec.num_layers)])
        self.final_layer_norm = (LayerNorm(spec.hidden_size, spec.eps, dtype, spec.norm_affine)
                                 if spec.final_norm and self.last else None)
        self.lm_head = ParallelLMHead(spec.vocab_size, embed_dim, dtype) if self.last else PPMissingLayer()
        if spec.tie_word_embeddings and first and self.last:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Optional[torch.Tensor]],
                meta: AttentionMetadata, intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """``intermediate``: the previous pipeline stage's (hidden states, the same) (every stage but
        the first); a stage but the last returns that pair for the next."""
        if intermediate is None:
            x = self.embed_tokens(input_ids)
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions)
        else:
            x = intermediate[0]
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer],
                                   kv_caches[self.start_layer:self.end_layer]):
            x = layer(x, kv_cache, meta)
        if not self.last:
            return x, x
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def checkpoint_entries(self, name: str, w: Any) -> Iterable[tuple[str, Any, Any]]:
        """Our (parameter name, tensor, shard id) for one checkpoint tensor; nothing to skip it."""
        for prefix in ("model.", "decoder."):  # HF saves model.decoder.*, some hub files decoder.*
            if name.startswith(prefix):
                name = name[len(prefix):]
        for frag in ("q", "k", "v"):
            if f".self_attn.{frag}_proj." in name:
                return [(name.replace(f"{frag}_proj", "qkv_proj"), w, frag)]
        return [(name, w, None)]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (checkpoint name, tensor or safetensors slice) pairs; returns the parameter names
        loaded. Raises ValueError on a shape mismatch or a missing weight."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        tied = self.spec.tie_word_embeddings
        shared = tied and "embed_tokens.weight" in params and "lm_head.weight" in params  # one tensor here
        for ckpt_name, w in weights:
            for name, tensor, shard in self.checkpoint_entries(ckpt_name, w):
                if tied and name == "lm_head.weight":
                    continue
                if tied and name == "embed_tokens.weight" and "embed_tokens.weight" not in params:
                    name = "lm_head.weight"  # the last pipeline stage's tied head, without the embedding
                load_param(params, loaded, name, tensor, shard)
        if shared:
            loaded.add("lm_head.weight")
        check_all_loaded(params, loaded)
        return loaded
