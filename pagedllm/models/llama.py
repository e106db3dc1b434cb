"""Llama family (Llama 2/3, Mistral): RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

Reference: Touvron et al., 2023, "Llama 2"; transformers' ``modeling_llama.py``. Qwen2 (q/k/v
bias) and Qwen3 (q/k RMSNorm) reuse these blocks with flags (see ``qwen2.py``, ``qwen3.py``).
Every layer is tensor-parallel (see ``layers/linear.py``).

Around the matmuls (vLLM's layout): the residual add is fused into the next RMSNorm call, RoPE's
cos/sin are gathered once per step (one table shared by all layers) and applied in place, and the
SwiGLU product takes two kernels. fp32 results stay bit-equal to transformers.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.config import get_rope_parameters
from pagedllm.distributed.parallel_state import get_pp_layer_range, get_tp_rank, is_first_pp_rank, is_last_pp_rank
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from pagedllm.layers.attention.backend import SlidingWindowBackend
from pagedllm.layers.fused_moe import verify_experts_loaded
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.weights import load_stacked
from pagedllm.platforms.layout import DecoderLayout, StepTokens, norm_paths


logger = logging.getLogger("pagedllm")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


class PPMissingLayer(nn.Identity):
    """Placeholder for a module another pipeline stage owns (no parameters, as in vLLM)."""


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x)). ``reduce_results=False``: the output is
    this rank's partial sum (a shared expert, which its MoE block all-reduces once with the experts)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, dtype=dtype, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def llama4_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """[N] float32: 1 + beta * log(1 + floor(p / original)) at each position p, Llama 4's attention
    temperature (Ministral 3's ``llama_4_scaling_beta``), in transformers' float32 operations
    (``get_llama_4_attn_scale``); 1 below ``original``."""
    return 1 + beta * torch.log(1 + torch.floor(positions / original))


class LlamaAttention(nn.Module):
    """forward(positions [N], x [N, hidden], kv_cache, meta, cos_sin=None) -> [N, hidden].
    ``rotary_emb``: a RotaryEmbedding shared with other layers (None: one of its own);
    ``cos_sin``: its ``cos_sin(positions)`` computed once per step (None: gathered here).
    ``query_scale`` (beta, original): the rotated queries are multiplied by ``llama4_query_scale``
    (None: not). ``sinks`` [H/tp] float32: attention-sink logits (gpt-oss's; None: none)."""

    query_scale: Optional[tuple[float, int]] = None
    qk_norm_after_rope = False  # HunYuan's q/k norms follow RoPE (Qwen3's precede it)

    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads, num_kv,
                                          bias=qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        # Seed-OSS sets the output projection's bias apart (attention_out_bias); Llama's covers all four.
        o_bias = getattr(config, "attention_out_bias", getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=o_bias, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.rotary_emb = rotary_emb or make_rotary_embedding(config, head_dim, dtype)
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.sinks: Optional[torch.Tensor] = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        if self.q_norm is not None and not self.qk_norm_after_rope:
            q, k = self.q_norm.forward_heads_(q), self.k_norm.forward_heads_(k)
        if isinstance(self.rotary_emb, RotaryEmbedding):
            if cos_sin is None:
                cos_sin = self.rotary_emb.cos_sin(positions)
            q, k = self.rotary_emb(positions, q, k, cos_sin=cos_sin)  # in place
        else:  # a model's own RoPE variant (Phi-3's LongRoPE): rotates on its own
            q, k = self.rotary_emb(positions, q, k)
        if self.q_norm is not None and self.qk_norm_after_rope:
            q, k = self.q_norm.forward_heads_(q), self.k_norm.forward_heads_(k)
        if self.query_scale is not None:
            scale = meta.derived.get("llama4_query_scale")  # once a step, shared by the layers
            if scale is None:
                scale = meta.derived["llama4_query_scale"] = llama4_query_scale(positions, *self.query_scale)
            q.mul_(scale.to(q.dtype).view(-1, 1, 1))
        if self.sinks is None:
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, sinks=self.sinks)
        return self.o_proj(o.reshape(n, -1))


def make_rotary_embedding(config: Any, head_dim: int, dtype) -> RotaryEmbedding:
    """The config's RoPE table; with ``partial_rotary_factor`` f (GLM's 0.5) on the first
    int(head_dim * f) channels of each head, as transformers computes it."""
    rope = get_rope_parameters(config)
    factor = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    return RotaryEmbedding(head_dim, config.max_position_embeddings, rope, dtype, rotary_dim=int(head_dim * factor))


def plain_layout(layer: nn.Module, layout: DecoderLayout, forward: str, layer_forward: Any,
                 attention_forwards: tuple, mlp_forward: Any, mlp_name: str,
                 norm_cls: type) -> tuple[Optional[DecoderLayout], str]:
    """(``layout``, "") when ``layer`` is the plain layer ``layout`` describes: its method ``forward``
    (the name) is ``layer_forward``, its attention's forward one of ``attention_forwards``, its MLP's
    ``mlp_forward`` (the dense gated MLP, called ``mlp_name`` in the reason), every norm at the layout's
    paths a ``norm_cls`` and its RoPE a RotaryEmbedding table; else (None, why not). A subclass that
    overrides one of those forwards is not described by the layout it inherits."""
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(type(layer), forward) is not layer_forward or type(attn).forward not in attention_forwards:
        return None, f"{type(layer).__name__} is not the plain {layout.kind} decoder layer"
    if type(mlp).forward is not mlp_forward:
        return None, f"MLP {type(mlp).__name__}, not the dense {mlp_name} one"
    for _, path in layout.norms:
        norm = layer
        for part in path.split(".") if path else ():
            norm = getattr(norm, part, None)
        if path and norm is not None and type(norm) is not norm_cls:
            return None, f"norm {type(norm).__name__}"
    if type(attn.rotary_emb) is not RotaryEmbedding:
        return None, f"RoPE variant {type(attn.rotary_emb).__name__}"
    return layout, ""


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; ``mlp`` replaces the dense SwiGLU MLP (e.g. a sparse MoE block).
    ``forward(positions, x, kv_cache, meta)`` -> hidden states (the plain API); ``forward_fused(...)``
    -> (x, residual), the residual stream kept apart as in vLLM so each residual add happens inside
    the next RMSNorm call. ``rotary_emb``: a RoPE table shared by all layers (None: one of its own).
    ``residual_multiplier``: what the attention and MLP outputs are multiplied by before they join the
    residual stream (Granite's; 1: nothing done)."""

    residual_multiplier = 1.0
    attention_cls = LlamaAttention
    # What the block is made of (platforms/layout.py), for a platform's fused layer stack: pre-norm,
    # RMSNorms (per-head q/k norms where the attention has them), a SwiGLU MLP.
    layout = DecoderLayout("llama", norm_paths({"in": "input_layernorm", "post": "post_attention_layernorm",
                                                "q": "self_attn.q_norm", "k": "self_attn.k_norm"}))

    def __init__(self, config: Any, dtype, backend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, dtype, backend, qkv_bias, qk_norm, rotary_emb)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size,
                                                        getattr(config, "mlp_bias", False), dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, x, kv_cache, meta):
        x, residual = self.forward_fused(positions, x.clone(), None, kv_cache, meta)
        return residual.add_(x)

    def decoder_layout(self) -> tuple[Optional[DecoderLayout], str]:
        """(``layout``, "") for the plain block (``plain_layout``), else (None, why not)."""
        return plain_layout(self, self.layout, "forward_fused", LlamaDecoderLayer.forward_fused,
                            (LlamaAttention.forward,), LlamaMLP.forward, "SwiGLU", RMSNorm)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this block's input (residual None: the first block; x becomes the residual stream and is
        updated in place) or the previous block's output, to be added to ``residual`` first.
        Returns (MLP output, residual stream); their sum is the block's output."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, cos_sin)
        if self.residual_multiplier != 1.0:
            x.mul_(self.residual_multiplier)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x.mul_(self.residual_multiplier)
        return x, residual


class LlamaForCausalLM(nn.Module):
    """forward: input_ids [N] (int64), positions [N] (int64) -> hidden states [N, hidden];
    compute_logits: hidden [M, hidden] -> logits [M, vocab_size] (float32)."""

    qkv_bias = False
    qk_norm = False
    decoder_layer_cls = LlamaDecoderLayer
    # Pipeline parallelism (worker/pp_runner.py): a subclass whose __init__/forward touch every layer says False.
    supports_pp = True
    # Whether ``sliding_window`` applies when the config has no ``use_sliding_window`` flag (Mistral's).
    sliding_window_by_default = False
    # A platform's fused stack of the decoder layers, set by the model runner (worker/model_runner.py):
    # (x, residual, rope tables, kv_caches, meta) -> (x, residual), or None where it does not cover the
    # step (then the layer loop runs). None: the loop always runs.
    layer_stack: Optional[Any] = None
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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = make_rotary_embedding(config, head_dim, dtype)  # one table for every layer
        self.layers = nn.ModuleList(
            [self.decoder_layer_cls(config, dtype, backend, qkv_bias, self.qk_norm, self.make_mlp(config, i, dtype),
                                    rotary_emb=self.rotary_emb)
             if self.start_layer <= i < self.end_layer else PPMissingLayer()
             for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if last else PPMissingLayer()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype) if last else PPMissingLayer()
        if getattr(config, "tie_word_embeddings", False) and first and last:
            self.lm_head.weight = self.embed_tokens.weight
        for layer, window in zip(self.layers, self.layer_windows(config)):
            if window and not isinstance(layer, PPMissingLayer):
                layer.self_attn.backend = SlidingWindowBackend(layer.self_attn.backend, window)

    @classmethod
    def layer_windows(cls, config: Any) -> list[Optional[int]]:
        """Each layer's sliding window (None: it attends to the whole context), as transformers
        reads the config: Mistral's ``sliding_window`` on every layer; where ``use_sliding_window``
        is set (Qwen2/3, SmolLM3), the layers ``layer_types`` calls sliding, else those from
        ``max_window_layers`` on."""
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if not window or not getattr(config, "use_sliding_window", cls.sliding_window_by_default):
            return [None] * n
        types = getattr(config, "layer_types", None)
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        first = getattr(config, "max_window_layers", 0) if hasattr(config, "use_sliding_window") else 0
        return [window if i >= first else None for i in range(n)]

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """Raise ValueError when ``max_model_len`` exceeds the RoPE table (sliding windows are
        implemented: ``layer_windows``)."""
        # The RoPE cos/sin tables hold max_position_embeddings positions (vLLM refuses a longer
        # max_model_len too); past them a step would index out of the table.
        table = getattr(config, "max_position_embeddings", None)
        if table and max_model_len > table:
            raise ValueError(f"{cls.__name__} has max_position_embeddings={table}; max_model_len={max_model_len} "
                             f"exceeds it (set max_model_len <= {table})")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Optional[torch.Tensor]],
                meta: AttentionMetadata,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """``intermediate``: the previous pipeline stage's (hidden states, residual stream), each
        [N, hidden] (every stage but the first); a stage but the last returns that pair for the next.
        ``inputs_embeds`` [N, hidden]: the first layer's input in place of ``embed_input(input_ids)``
        (images' rows scattered in by the model runner; updated in place)."""
        if inputs_embeds is None and intermediate is None and self.layer_stack is not None:
            tokens = self.step_tokens(input_ids, positions)
            # (the CPU layer runner: the embedding and RoPE gathers, all layers and the final norm in one C call)
            out = None if tokens is None else self.layer_stack(None, None, None, kv_caches, meta, tokens=tokens)
            if out is not None:
                return out
        if inputs_embeds is not None:
            x, residual = inputs_embeds, None
        else:
            x, residual = (self.embed_input(input_ids), None) if intermediate is None else intermediate
        tables = self.rope_tables(positions)
        ran = None if self.layer_stack is None else self.layer_stack(x, residual, tables, kv_caches, meta)
        if ran is not None:  # (the CPU layer runner: all layers in one C call)
            x, residual = ran
        else:
            for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer],
                                       kv_caches[self.start_layer:self.end_layer]):
                cos_sin = tables.get(id(layer.self_attn.rotary_emb)) if isinstance(tables, dict) else tables
                x, residual = layer.forward_fused(positions, x, residual, kv_cache, meta, cos_sin)
        if isinstance(self.norm, PPMissingLayer):
            return x, residual
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] (int64) -> the first layer's input [N, hidden] (a new tensor)."""
        return self.embed_tokens(input_ids)

    def step_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[StepTokens]:
        """What a fused stack needs to run a whole step from the token ids (``platforms/layout.py``), or
        None where this model's input embedding, RoPE tables or final norm are not the plain ops this
        class defines (a subclass overriding them: Granite's scaled embeddings, Qwen2-VL's M-RoPE; a
        GGUF embedding kept in blocks; a tensor- or pipeline-parallel rank)."""
        plain = self.__dict__.get("_plain_step_io")
        if plain is None:
            cls, emb, rope = type(self), self.embed_tokens, self.rotary_emb
            plain = (cls.embed_input is LlamaForCausalLM.embed_input and cls.rope_tables is LlamaForCausalLM.rope_tables
                     and type(emb) is VocabParallelEmbedding and emb.tp_size == 1
                     and getattr(emb, "gguf_embedding", None) is None and getattr(emb, "embed_dtype", None) is None
                     and isinstance(rope, RotaryEmbedding) and type(rope).cos_sin is RotaryEmbedding.cos_sin
                     and type(self.norm) is RMSNorm)
            self.__dict__["_plain_step_io"] = plain
        if not plain:
            return None
        return StepTokens(input_ids, positions, self.embed_tokens.weight, self.rotary_emb.cos_sin_cache,
                          self.norm.weight, self.norm.eps)

    def step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Optional[torch.Tensor]],
                    meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """The float32 logits [N, vocab_size] of every row of a whole step in the layer stack's one call,
        the LM head's matmul included (``StepTokens.lm_head``: the CPU layer runner), the values
        ``compute_logits(forward(...))`` gives; None, nothing run, where there is no such stack or this
        model's step (``step_tokens``) or LM head is not the plain one: a float32 head packed for the
        float GEMM on one rank, without bias, this class's ``compute_logits`` (not Granite's scaling)."""
        if self.layer_stack is None:
            return None
        head = self.__dict__.get("_plain_lm_head")
        if head is None:
            lm = self.lm_head
            w = getattr(lm, "gemm_weight", None)
            plain = (type(lm) is ParallelLMHead and lm.tp_size == 1 and type(lm.quant_method) is UnquantizedLinearMethod
                     and w is not None and w.dtype == torch.float32
                     and type(self).compute_logits is LlamaForCausalLM.compute_logits)
            head = (w, lm.out_features, lm.vocab_size) if plain else ()
            self.__dict__["_plain_lm_head"] = head
        tokens = self.step_tokens(input_ids, positions) if head else None
        if tokens is None:
            return None
        tokens.lm_head, tokens.lm_head_out, tokens.vocab = head
        return self.layer_stack(None, None, None, kv_caches, meta, tokens=tokens)

    def rotary_embs(self) -> list:
        """The RotaryEmbeddings whose tables ``rope_tables`` gathers (each layer's is one of them)."""
        return [self.rotary_emb]

    def rope_tables(self, positions: torch.Tensor) -> Any:
        """The step's RoPE table [N, 2, 1, R], gathered once and shared by the layers; None for a
        model whose RoPE variant rotates per layer (Phi-3's LongRoPE). A model whose layers take
        several tables returns id(RotaryEmbedding) -> its table (SmolLM3's NoPE layers)."""
        return self.rotary_emb.cos_sin(positions) if isinstance(self.rotary_emb, RotaryEmbedding) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        """The feed-forward block of layer ``layer_idx``; None builds the dense SwiGLU MLP (MoE
        families return their sparse block here)."""
        return None

    def prepare_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Checkpoint tensors -> as our layers take them (a family whose layout differs rewrites them:
        DeepSeek's interleaved RoPE rows); ``load_weights`` and an MTP layer's loader read through it."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (checkpoint name, tensor or safetensors slice) pairs; returns the parameter names
        loaded. Raises ValueError on a shape mismatch or a missing weight."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unused: list[str] = []  # checkpoint tensors no parameter of this stage took
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.replace("model.", "", 1) if name.startswith("model.") else name
            if tied and name == "lm_head.weight":
                continue
            if tied and name == "embed_tokens.weight" and name not in params:
                name = "lm_head.weight"  # the last pipeline stage holds the tied head without the embedding
            if not load_stacked(params, loaded, self.stacked_params, name, w):
                unused.append(name)
        if tied and "lm_head.weight" in params and "embed_tokens.weight" in params:
            loaded.add("lm_head.weight")
        self._log_unused(unused)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        verify_experts_loaded(self)  # (a stacked expert parameter counts as loaded once any expert is)
        return loaded

    def checkpoint_names(self) -> Optional[list[str]]:
        """The Hugging Face checkpoint names ``load_weights`` above routes into this rank's parameters
        (its steps reversed: the ``model.`` prefix put back, each fused parameter split into the
        fragments ``stacked_params`` fuses, and with a tied head the embedding's name, which the last
        pipeline stage loads into its head). A GGUF file's tensors are named from these
        (``models/gguf.py``) without building transformers' model, whose imports stay resident.
        None where a subclass routes names its own way (its own ``load_weights``, or stacked
        experts)."""
        if type(self).load_weights is not LlamaForCausalLM.load_weights \
                or self.stacked_params != LlamaForCausalLM.stacked_params:
            return None
        names = []
        for p, _ in self.named_parameters(remove_duplicate=False):
            parts = [p.replace(fused, frag) for frag, fused, _ in self.stacked_params if f".{fused}." in p] or [p]
            names += [n if n.startswith("lm_head.") else "model." + n for n in parts]
        if getattr(self.config, "tie_word_embeddings", False):
            names.append("model.embed_tokens.weight")
        return list(dict.fromkeys(names))

    def _log_unused(self, names: list[str]) -> None:
        """One log line naming the checkpoint tensors that no parameter took (another pipeline
        stage's are expected and not named): weights a model ignores should not go unnoticed."""
        def ours(name: str) -> bool:
            m = _LAYER_RE.match(name)
            if m:
                return self.start_layer <= int(m.group(1)) < self.end_layer
            top = name.split(".", 1)[0]
            return not isinstance(getattr(self, top, None), PPMissingLayer)
        names = [n for n in names if ours(n)]
        if names and get_tp_rank() == 0:
            logger.info("%d checkpoint tensor(s) not loaded (no parameter takes them): %s%s", len(names),
                        ", ".join(names[:6]), f" and {len(names) - 6} more" if len(names) > 6 else "")


class MistralForCausalLM(LlamaForCausalLM):
    sliding_window_by_default = True
