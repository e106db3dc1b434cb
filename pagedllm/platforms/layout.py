"""What a decoder layer is made of, as its model family declares it: the facts a platform's fused layer
stack (the CPU layer runner, ``platforms/cpu/layer_runner.py``) needs to decide whether it can run a
model's layers and to build itself, without importing any model or layer class.

A decoder layer class of ``pagedllm/models`` declares its ``DecoderLayout`` and answers, per layer
instance, ``decoder_layout() -> (layout, "")`` when the instance is that plain layer, or ``(None, why
not)`` when it is not (a subclass overriding its forward, its attention's or MLP's; another norm or RoPE
class). What varies per instance beyond that (weights, eps, scale, sliding window, soft-cap, residual
multiplier, attention variants such as sinks) the stack reads from the module instances themselves.
This module sits at the bottom of the package (models import it; platform wings read it): it imports
nothing of pagedllm.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

# The norm slots a layer may fill, in the order the fused stacks keep them:
# before attention, after attention, on q, on k, before the MLP, after the MLP.
NORM_SLOTS = ("in", "post", "q", "k", "pre_ff", "post_ff")

KINDS = ("llama", "gemma", "post_norm")  # the residual wirings (see DecoderLayout.kind)
NORMS = ("rms", "gemma_rms")
MLPS = ("swiglu", "gelu_tanh", "gated")
QK_NORMS = ("head", "whole")


@dataclass(frozen=True)
class DecoderLayout:
    """One decoder layer's structure.

    - ``kind``: how the residual stream runs through the layer. "llama": pre-norm (``in`` before
      attention, ``post`` before the MLP; each residual add fused into the next norm); "gemma": the
      stream updated in place, norms before and after each branch (``in``, ``post``, ``pre_ff``,
      ``post_ff``; Gemma 1 fills only ``in`` and ``pre_ff``); "post_norm": no norm before a branch,
      each branch's output normed (``post``, ``post_ff``) before its residual add (OLMo 2).
    - ``norms``: (slot, attribute path within the layer, e.g. "self_attn.q_norm"; None: no norm in
      that slot), one entry for each of ``NORM_SLOTS``, in that order. A norm module has ``weight``
      [width] and ``eps``.
    - ``norm``: every norm's formula over float32: "rms", x / rms(x) * w; "gemma_rms", x / rms(x) * (1 + w).
    - ``qk_norm``: the q/k norms' span where the layer has them: "head", each head's head_dim
      channels (Qwen3); "whole", all heads of a token at once (OLMo 2).
    - ``mlp``: down(act(gate(x)) * up(x)) with act SiLU ("swiglu"), GELU's tanh approximation
      ("gelu_tanh") or another ("gated": e.g. exact GELU);
      the MLP has ``gate_up_proj`` and ``down_proj``; the attention ``qkv_proj``, ``o_proj``,
      ``rotary_emb`` (a RoPE cos/sin table: ``rotary_dim``, ``cos_sin(positions)``), ``backend``,
      ``scale``, ``num_heads``, ``num_kv_heads`` and ``head_dim``.
    """

    kind: str
    norms: tuple[tuple[str, Optional[str]], ...]
    norm: str = "rms"
    qk_norm: str = "head"
    mlp: str = "swiglu"

    def __post_init__(self) -> None:
        if (self.kind not in KINDS or self.norm not in NORMS or self.qk_norm not in QK_NORMS
                or self.mlp not in MLPS or tuple(slot for slot, _ in self.norms) != NORM_SLOTS):
            raise ValueError(f"not a decoder layout: {self}")

    def replace(self, **changes) -> "DecoderLayout":
        """This layout with ``changes`` (field -> value); ``norms`` given as {slot: path} updates those slots."""
        if isinstance(changes.get("norms"), dict):
            changes["norms"] = tuple((slot, changes["norms"].get(slot, path)) for slot, path in self.norms)
        return dataclasses.replace(self, **changes)


def norm_paths(paths: dict) -> tuple[tuple[str, Optional[str]], ...]:
    """``DecoderLayout.norms`` from {slot: attribute path} (a slot not named: no norm there)."""
    unknown = set(paths) - set(NORM_SLOTS)
    if unknown:
        raise ValueError(f"unknown norm slots {sorted(unknown)} (slots: {NORM_SLOTS})")
    return tuple((slot, paths.get(slot)) for slot in NORM_SLOTS)


@dataclass
class StepTokens:
    """A whole decode or prefill step from its token ids, for a fused stack that also does what comes
    before and after the layers (the CPU layer runner's ``run_tokens``): ``input_ids`` and ``positions``
    [N] int64 tensors, the embedding table [vocab, hidden], the RoPE table [max_pos, 2, rotary_dim]
    (``RotaryEmbedding.cos_sin_cache``), the final RMSNorm's weight [hidden] and eps. A model passes
    them (``layer_stack(None, None, None, kv_caches, meta, tokens=...)``) only where its embedding, RoPE
    gather and final norm are those plain ops (models/llama.py).

    ``lm_head`` (None: the step returns the final norm's output [N, hidden]): the LM head's weight as
    the float GEMM packed it (``gemm_weight``, ``lm_head_out`` output columns, no bias), for a step
    that returns the logits [N, vocab] (the first ``vocab`` columns) of every row instead, its matmul
    in the same call (``LlamaForCausalLM.step_logits``)."""

    input_ids: Any
    positions: Any
    embed: Any
    rope_cache: Any
    norm_weight: Any
    norm_eps: float
    lm_head: Any = None
    lm_head_out: int = 0
    vocab: int = 0
