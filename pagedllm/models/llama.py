"""Llama family (Llama 2/3, Mistral): RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

Reference: Touvron et al., 2023, "Llama 2"; transformers' ``modeling_llama.py``. Qwen2 (q/k/v
bias) and Qwen3 (q/k RMSNorm) reuse these blocks with flags (see ``qwen2.py``, ``qwen3.py``).
Every layer is tensor-parallel (see ``layers/linear.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import get_rope_parameters
from pagedllm.distributed.parallel_state import get_pp_layer_range, is_first_pp_rank, is_last_pp_rank
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    default_weight_loader)
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


class PPMissingLayer(nn.Identity):
    """Placeholder for a module another pipeline stage owns (no parameters, as in vLLM)."""


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads, num_kv,
                                          bias=qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False), dtype=dtype)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, get_rope_parameters(config), dtype)
        self.scale = head_dim ** -0.5
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; ``mlp`` replaces the dense SwiGLU MLP (e.g. a sparse MoE block)."""

    def __init__(self, config: Any, dtype, backend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, backend, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size,
                                                        getattr(config, "mlp_bias", False), dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """forward: input_ids [N] (int64), positions [N] (int64) -> hidden states [N, hidden];
    compute_logits: hidden [M, hidden] -> logits [M, vocab_size] (float32)."""

    qkv_bias = False
    qk_norm = False
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
                      ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchPagedAttention()
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        # Pipeline parallelism: this rank builds only its stage's layers (others are placeholders).
        self.start_layer, self.end_layer = get_pp_layer_range(config.num_hidden_layers)
        first, last = is_first_pp_rank(), is_last_pp_rank()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) if first \
            else PPMissingLayer()
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, dtype, backend, qkv_bias, self.qk_norm, self.make_mlp(config, i, dtype))
             if self.start_layer <= i < self.end_layer else PPMissingLayer()
             for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if last else PPMissingLayer()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype) if last else PPMissingLayer()
        if getattr(config, "tie_word_embeddings", False) and first and last:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Optional[torch.Tensor]],
                meta: AttentionMetadata, intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``intermediate``: the previous pipeline stage's hidden states [N, hidden] (every stage
        but the first); a stage but the last returns its hidden states before the final norm."""
        x = self.embed_tokens(input_ids) if intermediate is None else intermediate
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer],
                                   kv_caches[self.start_layer:self.end_layer]):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        """The feed-forward block of layer ``layer_idx``; None builds the dense SwiGLU MLP (MoE
        families return their sparse block here)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (checkpoint name, tensor or safetensors slice) pairs; returns the parameter names
        loaded. Raises ValueError on a shape mismatch or a missing weight."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.replace("model.", "", 1) if name.startswith("model.") else name
            if tied and name == "lm_head.weight":
                continue
            if tied and name == "embed_tokens.weight" and name not in params:
                name = "lm_head.weight"  # the last pipeline stage holds the tied head without the embedding
            for frag, fused, shard in self.stacked_params:
                if f".{frag}." in name:
                    pname = name.replace(frag, fused)
                    if pname in params:
                        params[pname].weight_loader(params[pname], w, shard)
                        loaded.add(pname)
                    break
            else:
                if name in params:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, w)
                    loaded.add(name)
        if tied and "lm_head.weight" in params and "embed_tokens.weight" in params:
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass
