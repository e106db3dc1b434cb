"""Multi-token-prediction (MTP) layers shipped beside a model (DeepSeek-AI, 2024, "DeepSeek-V3 Technical
Report", section 2.2; GLM-4.5 uses the same layout), run by speculative decoding's ``mtp`` method
(``spec_decode/mtp.py``), as vLLM's ``deepseek_mtp.py`` / ``glm4_moe_mtp.py`` run them.

A checkpoint with ``num_nextn_predict_layers`` = D > 0 holds D such layers after the model's own, at
``model.layers.{num_hidden_layers + i}``:

    enorm, hnorm      RMSNorm [H] of the token embedding and of the target's hidden state
    eh_proj           [H, 2H] linear over concat(enorm(emb), hnorm(h))
    (a decoder layer) self_attn.*, mlp.*, input_layernorm, post_attention_layernorm: the family's own
                      block (DeepSeek-V3: MLA + MoE; GLM-4.5: GQA + MoE) at index num_hidden_layers + i
    shared_head.norm  RMSNorm [H], then shared_head.head [V, H]: the logits
    embed_tokens      a copy of the model's embedding (not loaded: the model's own is used)

For the target's last hidden state h_i at position i (after the model's final norm, as vLLM hands it
over) and the token t_{i+1}, the layer at position i gives

    h'_i = Block(eh_proj(concat(enorm(emb(t_{i+1})), hnorm(h_i))))   and   logits(t_{i+2}) = head(norm(h'_i))

with the embedding zeroed at position 0 (vLLM's ``inputs_embeds[positions == 0] = 0``). The block
attends over the layer's own paged KV cache of earlier positions (one layer's worth). Only the first
of D layers is used (every released checkpoint has D = 1); k > 1 proposals reuse it autoregressively
with h'_i as the next step's h, as vLLM does.

Xiaomi's MiMo (``MiMoForCausalLM``, Qwen2's layers; vLLM's ``mimo_mtp.py``) keeps its layers at
``model.mtp_layers.{i}``: ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` over
concat(hidden_layernorm(h), token_layernorm(emb)) (the hidden state first), ``mtp_block`` (a Qwen2
decoder layer), ``final_layernorm``, and the model's own LM head: h' = final_layernorm(Block(...)), the
logits lm_head(h'), and h' (normed) the next step's h (``MiMoMultiTokenPredictor``).

A model class says which layout its checkpoints use in ``mtp_layout`` ("deepseek" or "mimo"; absent:
no MTP support).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.fused_moe import verify_experts_loaded
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.vocab_embedding import ParallelLMHead
from pagedllm.models.weights import check_all_loaded, load_stacked

logger = logging.getLogger("pagedllm")

# the layer's own tensors (the rest of model.layers.{n}.* is its decoder block)
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")


def num_mtp_layers(hf_config: Any) -> int:
    """``num_nextn_predict_layers`` of a config (0 where it has none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def _layer_index(name: str) -> int:
    """The N of a name's ``layers.N.`` (-1 where it has none)."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def skip_mtp_layers(weights: Iterable[tuple[str, Any]], num_hidden_layers: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors without the MTP layers (indices from ``num_hidden_layers`` on, or MiMo's
    ``model.mtp_layers.*``), which the model itself does not hold (transformers does not load them either)."""
    for name, w in weights:
        if _layer_index(name) < num_hidden_layers and ".mtp_layers." not in f".{name}":
            yield name, w


class SharedHead(nn.Module):
    """``shared_head``: norm [H] and head [V, H]. hidden [M, H] -> float32 logits [M, V]."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(self.norm(hidden)).float()


def make_mtp_predictor(target: nn.Module, dtype: torch.dtype) -> "MultiTokenPredictor":
    """The first MTP layer of ``target`` (a loaded model whose class has an ``mtp_layout``), unloaded."""
    cls = MiMoMultiTokenPredictor if target.mtp_layout == "mimo" else MultiTokenPredictor
    return cls(target, target.config.num_hidden_layers, dtype)


class MultiTokenPredictor(nn.Module):
    """One MTP layer of ``target`` (a loaded DeepSeek-V3 / GLM-4.5 family model, unsharded): its block is
    the family's decoder layer (``decoder_layer_cls``, ``make_mlp`` at index ``layer_idx``), sharing the
    target's RoPE table and attention backend; the embedding is the target's (not a parameter here).

    ``forward(input_ids [N] int64, positions [N] int64, hidden [N, H], kv_cache, meta)`` -> h' [N, H] in
    the model's dtype (input_ids[j] is the token after position positions[j], hidden[j] the state at
    it); ``compute_logits(h' [M, H])`` -> float32 [M, V].
    """

    def __init__(self, target: nn.Module, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        config = target.config
        h = config.hidden_size
        self.embed: Callable[[torch.Tensor], torch.Tensor] = target.embed_input  # (a method: no parameter)
        self.enorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, dtype=dtype)
        first = target.layers[0].self_attn
        qkv_bias = target.qkv_bias or getattr(config, "attention_bias", False)
        self.block = target.decoder_layer_cls(config, dtype, first.backend, qkv_bias, target.qk_norm,
                                              target.make_mlp(config, layer_idx, dtype), rotary_emb=target.rotary_emb)
        self.block.self_attn.rotary_emb = first.rotary_emb  # (DeepSeek's layers share a qk_rope table)
        self.shared_head = SharedHead(config, dtype)
        self.layer_idx = layer_idx
        self.stacked_params = target.stacked_params

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        emb = self.embed(input_ids)
        emb[positions == 0] = 0  # as vLLM: the first position's input is masked
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        return self.block(positions, x, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head(hidden)

    @property
    def prefix(self) -> str:
        """The checkpoint names' prefix of this layer's tensors."""
        return f"model.layers.{self.layer_idx}."

    def param_name(self, rest: str) -> str | None:
        """A tensor's name after ``prefix`` -> our parameter's (None: not ours to load)."""
        if rest.startswith("embed_tokens."):
            return None  # the target's embedding is used
        return rest if rest.split(".", 1)[0] in _OWN else f"block.{rest}"

    def keeps(self, name: str) -> bool:
        """Whether a checkpoint tensor is one of this layer's."""
        return name.startswith(self.prefix)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load the tensors of ``prefix`` (others are skipped; they arrive through the target's
        ``prepare_weights``). Raises ValueError naming what is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            if not self.keeps(name):
                continue
            pname = self.param_name(name[len(self.prefix):])
            if pname is None:
                continue
            if not load_stacked(params, loaded, self.stacked_params, pname, w):
                logger.info("MTP layer: checkpoint tensor %s not loaded (no parameter takes it)", name)
        check_all_loaded(params, loaded)
        verify_experts_loaded(self)
        return loaded


class MiMoMultiTokenPredictor(MultiTokenPredictor):
    """MiMo's layout (module docstring): ``forward`` returns final_layernorm's output, ``compute_logits`` is
    the target's LM head; the block is ``mtp_block``."""

    def __init__(self, target: nn.Module, layer_idx: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        config = target.config
        h = config.hidden_size
        self.embed = target.embed_input
        self.head = target.compute_logits  # (a method: the target's LM head, no parameter here)
        self.token_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.hidden_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.input_proj = ReplicatedLinear(2 * h, h, bias=False, dtype=dtype)
        qkv_bias = target.qkv_bias or getattr(config, "attention_bias", False)
        self.mtp_block = target.decoder_layer_cls(config, dtype, target.layers[0].self_attn.backend, qkv_bias,
                                                  target.qk_norm, None, rotary_emb=target.rotary_emb)
        self.final_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.layer_idx = 0  # model.mtp_layers.0
        self.stacked_params = target.stacked_params

    @property
    def block(self) -> nn.Module:
        return self.mtp_block

    @property
    def prefix(self) -> str:
        return f"model.mtp_layers.{self.layer_idx}."

    def param_name(self, rest: str) -> str | None:
        return rest

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        emb = self.embed(input_ids)
        emb[positions == 0] = 0
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], dim=-1))
        return self.final_layernorm(self.mtp_block(positions, x, kv_cache, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def mtp_checkpoint_weights(iterate: Callable[[Callable[[str], bool]], Iterable[tuple[str, Any]]], target: nn.Module,
                           layer: MultiTokenPredictor) -> Iterable[tuple[str, Any]]:
    """The MTP layer's tensors as the target's layers take them: ``iterate(keep)`` reads the checkpoint's
    tensors whose names ``keep`` accepts (``models/loader.checkpoint_tensors``)."""
    return target.prepare_weights(iterate(layer.keeps))
