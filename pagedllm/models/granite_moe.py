"""IBM Granite MoE models (transformers' ``modeling_granitemoe.py``, ``..._granitemoeshared.py``,
``..._granitemoehybrid.py``): Granite's layer (``granite.py``: embedding, attention, residual and
logits multipliers) with the MLP replaced by

- Granite 3.x MoE (1B-A400M, 3B-A800M): routed experts; the router takes the top-k experts by
  logit and weights them by a softmax over those k (the same weights as a softmax over all experts
  renormalized over the k kept, which ``FusedMoE(renormalize=True)`` computes);
- Granite MoE Shared: the same plus a dense SwiGLU ``shared_mlp`` every token goes through;
- Granite 4.0 (``GraniteMoeHybridForCausalLM``) whose every layer is attention (granite-4.0-micro):
  the shared MLP, with or without experts, and RoPE or none (``position_embedding_type``). The
  hybrid checkpoints with Mamba-2 layers (granite-4.0-h-*) are refused: there is no SSM state cache.

Checkpoints keep the experts stacked: ``block_sparse_moe.input_linear.weight`` [E, 2I, H] (gate rows,
then up rows), ``output_linear.weight`` [E, H, I], ``router.layer.weight`` [E, H];
``shared_mlp.input_linear.weight`` [2S, H] and ``output_linear.weight`` [H, S]. They are split into
the per-expert / per-projection tensors the fused layers load (tensor-parallel slices included).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear, load_full
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.smollm3 import NoPELayers


class GraniteMoeBlock(nn.Module):
    """``router`` + routed ``experts`` (when the config has any) + ``shared_mlp`` (when it has a
    shared size); one all-reduce after both. forward: [N, hidden] -> [N, hidden]."""

    def __init__(self, config: Any, dtype: torch.dtype, shared_size: int) -> None:
        super().__init__()
        num_experts = getattr(config, "num_local_experts", 0) or 0
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
                                renormalize=True, dtype=dtype, reduce_results=False)
        self.shared_mlp = None
        if shared_size:
            self.shared_mlp = LlamaMLP(config.hidden_size, shared_size, bias=False, dtype=dtype,
                                       reduce_results=False)  # one all-reduce, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.router(x))
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        return tensor_model_parallel_all_reduce(out)


def split_stacked(weights: Iterable[tuple[str, Any]], dense_shared: bool) -> Iterator[tuple[str, Any]]:
    """Granite's stacked MoE / shared-MLP tensors as the per-expert and per-projection names the
    layers load (``FusedMoE.expert_params_mapping("w1", "w3", "w2")``, LlamaMLP's gate/up/down);
    ``dense_shared``: the shared MLP is the layer's whole MLP (no experts)."""
    for name, w in weights:
        name = name.replace(".block_sparse_moe.router.layer.", ".mlp.router.")
        if name.endswith(".block_sparse_moe.input_linear.weight"):  # [E, 2I, H]: gate rows, then up rows
            t = load_full(w)
            prefix, inter = name.replace(".block_sparse_moe.input_linear.weight", ".mlp.experts."), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.w1.weight", t[e, :inter]
                yield f"{prefix}{e}.w3.weight", t[e, inter:]
        elif name.endswith(".block_sparse_moe.output_linear.weight"):  # [E, H, I]
            t = load_full(w)
            prefix = name.replace(".block_sparse_moe.output_linear.weight", ".mlp.experts.")
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.w2.weight", t[e]
        elif ".shared_mlp." in name:
            name = name.replace(".shared_mlp.", ".mlp." if dense_shared else ".mlp.shared_mlp.")
            if name.endswith(".input_linear.weight"):  # [2S, H]: gate rows, then up rows
                t = load_full(w)
                half = t.shape[0] // 2
                yield name.replace(".input_linear.", ".gate_proj."), t[:half]
                yield name.replace(".input_linear.", ".up_proj."), t[half:]
            else:
                yield name.replace(".output_linear.", ".down_proj."), w
        else:
            yield name, w


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite 3.x MoE (no shared MLP)."""

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        if self.num_experts(config):  # expert entries first: ``experts.N.w1`` must not fall through
            self.stacked_params = FusedMoE.expert_params_mapping("w1", "w3", "w2", config.num_local_experts) \
                + LlamaForCausalLM.stacked_params

    @staticmethod
    def num_experts(config: Any) -> int:
        return getattr(config, "num_local_experts", 0) or 0

    def shared_size(self, config: Any) -> int:
        return 0

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        if not self.num_experts(config):  # the shared MLP is the whole MLP
            return LlamaMLP(config.hidden_size, self.shared_size(config), bias=False, dtype=dtype)
        return GraniteMoeBlock(config, dtype, self.shared_size(config))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(split_stacked(weights, dense_shared=not self.num_experts(self.config)))


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared MLP (``shared_intermediate_size``)."""

    def shared_size(self, config: Any) -> int:
        return getattr(config, "shared_intermediate_size", 0) or 0


class GraniteMoeHybridForCausalLM(NoPELayers, GraniteMoeSharedForCausalLM):
    """Granite 4.0 whose layers are all attention; RoPE only with ``position_embedding_type: rope``."""

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        if getattr(config, "position_embedding_type", None) != "rope":
            self.set_nope([False] * config.num_hidden_layers)
        else:
            self.no_rope_emb = None

    def rotary_embs(self) -> list:
        return [self.rotary_emb] if self.no_rope_emb is None else super().rotary_embs()

    def rope_tables(self, positions: torch.Tensor) -> Any:
        return LlamaForCausalLM.rope_tables(self, positions) if self.no_rope_emb is None \
            else super().rope_tables(positions)

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """As Llama's; every layer must be attention (Mamba-2 layers have no state cache here)."""
        super().verify_config(config, max_model_len)
        types = getattr(config, "layer_types", None) or []
        # transformers names Mamba layers "linear_attention" (config.json: "mamba")
        mamba = [i for i, t in enumerate(types) if t not in ("attention", "full_attention")]
        if mamba:
            raise ValueError(f"GraniteMoeHybridForCausalLM: layers {mamba[:6]}{' ...' if len(mamba) > 6 else ''} are "
                             f"Mamba-2 layers ({types[mamba[0]]!r}); only checkpoints whose every layer is attention "
                             f"(granite-4.0-micro) are supported")
