"""PEFT's LoRA format read and checked: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT (huggingface/peft, ``tuners/lora``) stores per target linear ``...layers.<i>.<path>.lora_A.weight``
[r, in_features] and ``lora_B.weight`` [out_features, r]; the layer computes W x + s * B A x with
s = lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA (``use_rslora``, Kalajdzievski 2023).

Served here: targets among q/k/v/o/gate/up/down_proj of the decoder layers (``TARGETS``), any rank up to
``--max-lora-rank``. Refused, with the reason named: ``modules_to_save`` (full copies of modules), other
targets (lm_head, embed_tokens, ...), biases, DoRA, per-module rank/alpha patterns, pickled ``.bin``.
Every refusal is a ``LoRAFormatError`` (a ValueError: the server answers 400).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.((?:[A-Za-z_0-9]+\.)*)([A-Za-z_0-9]+)\.lora_([AB])\.weight$")


class LoRAFormatError(ValueError):
    """An adapter that cannot be served (malformed, too large a rank, unsupported parts)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU, unsharded, in float32.

    ``weights``: "layers.<i>.<module path>" (e.g. "layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]);
    ``scale``: what B A x is multiplied by (alpha / r, or alpha / sqrt(r) with rsLoRA)."""
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    targets: tuple[str, ...] = ()

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """target name -> (out_features, in_features) of the base model's unsharded linear."""
    c = hf_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(c, "intermediate_size", None)
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * head_dim)}
    if inter:
        shapes.update(gate_proj=(inter, hidden), up_proj=(inter, hidden), down_proj=(hidden, inter))
    return shapes


def read_adapter_config(path: str) -> dict:
    """adapter_config.json of the folder ``path``. Raises LoRAFormatError when missing or not JSON."""
    if not path or not os.path.isdir(path):
        raise LoRAFormatError(f"LoRA adapter path {path!r} is not a folder")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAFormatError(f"no adapter_config.json in {path}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAFormatError(f"adapter_config.json in {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAFormatError(f"adapter_config.json in {path} is not a JSON object")
    return cfg


def check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config. Raises LoRAFormatError naming what is not served."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAFormatError(f"peft_type {peft_type} is not LoRA")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAFormatError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAFormatError(f"LoRA rank {r} is greater than max_lora_rank {max_rank} (--max-lora-rank)")
    if cfg.get("modules_to_save"):
        raise LoRAFormatError(f"modules_to_save is not supported (full copies of {cfg['modules_to_save']})")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAFormatError(f"LoRA bias={cfg['bias']!r} is not supported (only bias='none')")
    if cfg.get("use_dora"):
        raise LoRAFormatError("DoRA (use_dora) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAFormatError(f"{key} (per-module ranks or alphas) is not supported")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAFormatError(f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def load_peft_adapter(path: str, max_rank: int, hf_config: Any = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder. ``hf_config``: the base model's config, to check shapes and
    layer indices against (None: not checked). Raises LoRAFormatError (a ValueError) naming the reason."""
    cfg = read_adapter_config(path)
    rank, scale = check_config(cfg, max_rank)
    st = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        extra = " (adapter_model.bin is pickled: save with safe_serialization=True)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAFormatError(f"no adapter_model.safetensors in {path}{extra}")
    shapes = expected_shapes(hf_config) if hf_config is not None else None
    num_layers = getattr(hf_config, "num_hidden_layers", None)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(st, framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    what = key.rsplit(".lora_", 1)[0] if ".lora_" in key else key
                    raise LoRAFormatError(f"adapter tensor {key!r}: target {what.split('.')[-1]!r} is not supported "
                                          f"(LoRA targets: {', '.join(TARGETS)} of the decoder layers)")
                layer, parents, target, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                if target not in TARGETS:
                    raise LoRAFormatError(f"target module {target!r} is not supported (LoRA targets: {', '.join(TARGETS)})")
                if num_layers is not None and layer >= num_layers:
                    raise LoRAFormatError(f"adapter tensor {key!r}: layer {layer} is past the model's {num_layers} layers")
                name = f"layers.{layer}.{parents}{target}"
                halves.setdefault(name, {})[half] = f.get_tensor(key).float()
    except LoRAFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any safetensors failure is a malformed adapter
        raise LoRAFormatError(f"cannot read {st}: {type(e).__name__}: {e}") from None
    if not halves:
        raise LoRAFormatError(f"{st} holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, h in halves.items():
        if set(h) != {"A", "B"}:
            raise LoRAFormatError(f"{name}: lora_A and lora_B must both be present")
        a, b = h["A"], h["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAFormatError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank {rank}")
        target = name.rsplit(".", 1)[1]
        if shapes is not None:
            want = shapes.get(target)
            if want is None or (b.shape[0], a.shape[1]) != want:
                raise LoRAFormatError(f"{name}: B A is {b.shape[0]}x{a.shape[1]}, the base model's {target} is "
                                      f"{want[0] if want else '?'}x{want[1] if want else '?'}")
        weights[name] = (a.contiguous(), b.contiguous())
    targets = tuple(sorted({n.rsplit(".", 1)[1] for n in weights}, key=TARGETS.index))
    return LoRAAdapter(rank=rank, scale=scale, weights=weights, targets=targets)


def adapter_summary(adapter: LoRAAdapter) -> str:
    return f"rank {adapter.rank}, scale {adapter.scale:g}, targets {'/'.join(adapter.targets)}"


