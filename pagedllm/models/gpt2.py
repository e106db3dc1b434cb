"""GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask Learners"): the OPT
decoder (``opt.py``) with pre-LayerNorm, a tanh-GELU MLP and no position offset (transformers'
``modeling_gpt2.py``).

The checkpoint stores its linear weights as Conv1D, [in_features, out_features] (transposed from
``nn.Linear``), and q/k/v fused in ``c_attn``; loading transposes them and splits ``c_attn``.
"""
from __future__ import annotations

from typing import Any, Iterable

from pagedllm.layers.linear import load_full
from pagedllm.models.opt import DecoderSpec, OPTForCausalLM

# GPT-2 module name -> ours (OPT's); the Conv1D ones are transposed on load.
_RENAMES = [("wte.", "embed_tokens."), ("wpe.", "embed_positions."), ("ln_f.", "final_layer_norm."),
            ("h.", "layers."), (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.out_proj."),
            (".ln_1.", ".self_attn_layer_norm."), (".ln_2.", ".final_layer_norm."), (".mlp.c_fc.", ".fc1."),
            (".mlp.c_proj.", ".fc2.")]
_CONV1D = (".qkv_proj.weight", ".out_proj.weight", ".fc1.weight", ".fc2.weight")


class GPT2LMHeadModel(OPTForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        return DecoderSpec(
            vocab_size=config.vocab_size, hidden_size=config.n_embd, num_heads=config.n_head,
            num_layers=config.n_layer, ffn_dim=config.n_inner or 4 * config.n_embd,
            max_positions=config.n_positions, position_offset=0, activation=config.activation_function,
            eps=config.layer_norm_epsilon,
            scale_by_inverse_layer_idx=getattr(config, "scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True))

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        super().verify_config(config, max_model_len)
        if not getattr(config, "scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_weights=False is not supported")

    def checkpoint_entries(self, name: str, w: Any) -> Iterable[tuple[str, Any, Any]]:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return []  # causal-mask buffers in old checkpoints, not weights
        if name.startswith("transformer."):
            name = name[len("transformer."):]
        for old, new in _RENAMES:
            if name.startswith(old) if not old.startswith(".") else old in name:
                name = name.replace(old, new, 1)
        if name.endswith(_CONV1D):
            w = load_full(w).t()
        if ".qkv_proj." in name:  # [3 * hidden] rows after the transpose: q, k, v
            w = load_full(w)
            size = w.shape[0] // 3
            return [(name, w.narrow(0, i * size, size), s) for i, s in enumerate("qkv")]
        return [(name, w, None)]
