"""Gemma 2 (Gemma Team, 2024, "Gemma 2: Improving Open Language Models at a Practical Size"):
transformers' ``modeling_gemma2.py``. Against Llama it adds

- sliding-window layers interleaved with global ones (``config.layer_types``; older configs:
  even layers slide): a sliding layer's query at position p sees keys p - W < j <= p;
- logit soft-capping, c * tanh(x / c): on attention scores (``attn_logit_softcapping``) and on
  the final logits (``final_logit_softcapping``);
- four RMSNorms per layer (before and after attention and MLP), all x * (1 + weight);
- token embeddings scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
- a GELU-tanh gated MLP and attention scale ``query_pre_attn_scalar ** -0.5``.

Gemma 3 (``gemma3.py``) is this decoder with q/k norms and a RoPE base per layer type. The
checkpoint layout is Llama's, so loading reuses ``LlamaForCausalLM.load_weights``. KV blocks
are kept for the whole context (global layers need them); none are freed early.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.config import get_rope_parameters
from pagedllm.distributed.parallel_state import get_pp_layer_range, is_first_pp_rank, is_last_pp_rank
from pagedllm.platforms import ops
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import LlamaForCausalLM, PPMissingLayer, plain_layout
from pagedllm.platforms.layout import DecoderLayout, norm_paths


GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # the tanh approximation's names (activation.py)


def soft_cap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(x / cap) (identity when cap is None or 0)."""
    return torch.tanh(x / cap) * cap if cap else x


def layer_types(config: Any, default_pattern: int) -> list[str]:
    """``sliding_attention`` or ``full_attention`` for each layer: ``config.layer_types``, else
    every ``sliding_window_pattern``-th layer global, the others sliding (older configs)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or default_pattern
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


def gemma_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class GemmaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with act = GELU (tanh approximation in Gemma 2/3 configs)."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, dtype=dtype)
        self.act = get_act_fn(act)
        self.gelu_tanh = act in GELU_TANH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu_tanh:  # one pass where the platform has the kernel (ops.gelu_tanh_and_mul)
            return self.down_proj(ops.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma2Attention(nn.Module):
    qk_norm = False

    def __init__(self, config: Any, layer_type: str, rotary: RotaryEmbedding, dtype, backend: AttentionBackend) -> None:
        super().__init__()
        head_dim = gemma_head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=getattr(config, "attention_bias", False),
                                          dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False), dtype=dtype)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if self.qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if self.qk_norm else None
        self.rotary_emb = rotary  # shared by the layers of one type
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5  # Gemma 1: head_dim
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        self.logits_soft_cap = getattr(config, "attn_logit_softcapping", None)
        self.backend = backend
        # steps with image spans that attend both ways, on a backend that cannot (PrefillSeq.bidirectional)
        self.reference_backend = TorchPagedAttention()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; ``cos_sin``: this layer type's RoPE table at the step's
        positions (None: gathered here)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm.forward_heads_(q), self.k_norm.forward_heads_(k)
        q, k = self.rotary_emb(positions, q, k, cos_sin=cos_sin)
        backend = self.backend
        if not backend.supports_bidirectional and meta.has_bidirectional:  # images of Gemma 3 (a GPU kernel)
            backend = self.reference_backend
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                            logits_soft_cap=self.logits_soft_cap)
        return self.o_proj(o.reshape(n, -1))


def gemma_layout(layer: nn.Module, layer_forward: Any) -> tuple[Optional[DecoderLayout], str]:
    """(``layer.layout``, "") for a plain Gemma layer whose forward is ``layer_forward`` (``llama.plain_layout``
    over Gemma2Attention, GemmaMLP and GemmaRMSNorms), its MLP's activation GELU-tanh or another
    ("gated"); else (None, why not)."""
    layout = layer.layout if getattr(layer.mlp, "gelu_tanh", False) else layer.layout.replace(mlp="gated")
    return plain_layout(layer, layout, "forward", layer_forward, (Gemma2Attention.forward,), GemmaMLP.forward,
                        "GELU-tanh", GemmaRMSNorm)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention
    # What the block is made of (platforms/layout.py): the residual stream updated in place, x * (1 + w)
    # RMSNorms before and after attention and the MLP (q/k norms per head: Gemma 3), a GELU-tanh MLP.
    layout = DecoderLayout("gemma", norm_paths({"in": "input_layernorm", "post": "post_attention_layernorm",
                                                "q": "self_attn.q_norm", "k": "self_attn.k_norm",
                                                "pre_ff": "pre_feedforward_layernorm",
                                                "post_ff": "post_feedforward_layernorm"}),
                           norm="gemma_rms", mlp="gelu_tanh")

    def __init__(self, config: Any, layer_type: str, rotary: RotaryEmbedding, dtype, backend: AttentionBackend) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_cls(config, layer_type, rotary, dtype, backend)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        self.mlp = GemmaMLP(h, config.intermediate_size, act, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions, x, kv_cache, meta, cos_sin=None):
        """x [N, hidden]: the residual stream, updated in place and returned (each post-norm's add
        fused with the next norm)."""
        o = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, cos_sin)
        h = self.post_attention_layernorm.add_to_(x, o, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_to_(x, self.mlp(h))

    def decoder_layout(self) -> tuple[Optional[DecoderLayout], str]:
        return gemma_layout(self, Gemma2DecoderLayer.forward)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """forward: input_ids [N] (int64), positions [N] (int64) -> hidden states [N, hidden];
    compute_logits: hidden [M, hidden] -> soft-capped logits [M, vocab_size] (float32)."""

    decoder_layer_cls = Gemma2DecoderLayer
    sliding_window_pattern = 2  # when the config has no layer_types: one global layer in 2

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None,
                 max_model_len: Optional[int] = None) -> None:
        nn.Module.__init__(self)  # Llama's checkpoint layout and loader, not its blocks
        self.config = config
        backend = backend or TorchPagedAttention()
        # Pipeline parallelism: this rank builds only its stage's layers (others are placeholders).
        self.start_layer, self.end_layer = get_pp_layer_range(config.num_hidden_layers)
        first, last = is_first_pp_rank(), is_last_pp_rank()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) if first \
            else PPMissingLayer()
        # transformers keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5, dtype=dtype), persistent=False)
        types = layer_types(config, self.sliding_window_pattern)
        # One cos/sin table per layer type, for the positions the engine can reach.
        positions = max_model_len or config.max_position_embeddings
        rotary = {t: RotaryEmbedding(gemma_head_dim(config), positions, self.rope_for(config, t), dtype)
                  for t in sorted(set(types))}
        self.layers = nn.ModuleList([self.decoder_layer_cls(config, t, rotary[t], dtype, backend)
                                     if self.start_layer <= i < self.end_layer else PPMissingLayer()
                                     for i, t in enumerate(types)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if last else PPMissingLayer()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype) if last else PPMissingLayer()
        if getattr(config, "tie_word_embeddings", True) and first and last:
            self.lm_head.weight = self.embed_tokens.weight
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def rope_for(config: Any, layer_type: str) -> dict:
        return get_rope_parameters(config)

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """Sliding windows are implemented, so any ``max_model_len`` is served; bidirectional
        attention (embedding models built on Gemma 3) is not causal generation and is refused."""
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{cls.__name__}: use_bidirectional_attention=True (an embedding model) is not supported")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Optional[torch.Tensor]],
                meta: AttentionMetadata, intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """``intermediate``: the previous pipeline stage's (residual stream, the same) (every stage
        but the first); a stage but the last returns that pair for the next (the stream is all
        Gemma's layers pass on; the pair keeps the stages' protocol). ``inputs_embeds`` [N, hidden]:
        the first layer's input in place of ``embed_input(input_ids)`` (images' rows scattered in by
        the model runner; updated in place)."""
        if inputs_embeds is not None:
            x = inputs_embeds
        elif intermediate is None:
            x = self.embed_input(input_ids)  # a new tensor: the layers update it in place
        else:
            x = intermediate[0]
        cos_sin = self.cos_sin(positions)
        # the model runner's fused stack (the CPU layer runner: all layers in one C call), else the loop
        ran = (None if self.layer_stack is None or meta.has_bidirectional  # (the C runner's attention is causal)
               else self.layer_stack(x, None, cos_sin, kv_caches, meta))
        if ran is None:
            for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer],
                                       kv_caches[self.start_layer:self.end_layer]):
                x = layer(positions, x, kv_cache, meta, cos_sin[id(layer.self_attn.rotary_emb)])
        if isinstance(self.norm, PPMissingLayer):
            return x, x
        return self.norm(x)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> the token embeddings times sqrt(hidden_size) [N, hidden] (a new tensor)."""
        return self.embed_tokens(input_ids) * self.normalizer

    def rotary_embs(self) -> list:
        """The RotaryEmbeddings whose tables ``cos_sin`` gathers: one per layer type."""
        return list({id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb
                     for layer in self.layers[self.start_layer:self.end_layer]}.values())

    def cos_sin(self, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        """id(RotaryEmbedding) -> its table at ``positions``: one gather per layer type a step."""
        tables: dict[int, torch.Tensor] = {}
        for layer in self.layers[self.start_layer:self.end_layer]:
            rot = layer.self_attn.rotary_emb
            if id(rot) not in tables:
                tables[id(rot)] = rot.cos_sin(positions)
        return tables

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.compute_logits(hidden), self.final_soft_cap).float()
