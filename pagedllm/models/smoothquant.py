"""SmoothQuant's calibration, the loader's step before the linear methods quantize the weights
(``smooth_for_quantization``): run the float model, record each linear input's per-channel max |x|,
and fold the factors into the weights through the layers' folds (the method, its factors and folds:
``pagedllm/layers/quantization/smoothquant.py``).

Calibration: one forward pass of the float model at load, without a KV cache, over a fixed set of
short English texts and chat turns shipped here (``CALIBRATION_TEXTS``, ``CALIBRATION_CHATS``;
about 1,000 tokens), through the model's tokenizer and chat template; forward pre-hooks record
each linear input's per-channel abs-max. The layers smoothed are the decoder layers with Llama's
structure (``smoothable_layers``). Tensor parallelism: every rank runs the same pass (the
collectives of the forward included). Pipeline parallelism: each stage runs its layers of the same
pass, receiving the previous stage's hidden states and residual stream and sending its own on
(point-to-point, as a step does), so every stage sees PP=1's activations.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_rank, get_pp_size, pp_recv, pp_send
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.quantization.smoothquant import (
    smooth_attention_output, smooth_mlp, smooth_norm_into, smoothquant_alpha)
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.models.llama import LlamaDecoderLayer, LlamaMLP

logger = logging.getLogger("pagedllm")

# Generic English, written for this file (no data set is shipped or downloaded).
CALIBRATION_TEXTS = [
    "The morning train was late again, so she read the newspaper on the platform and drank her coffee.",
    "Water boils at one hundred degrees Celsius at sea level, but at a lower temperature in the mountains.",
    "He planted tomatoes, beans and a row of sunflowers along the fence behind the old house.",
    "The committee will meet on Thursday to discuss the budget for next year and the new library.",
    "Our cat sleeps most of the day and wakes up only when someone opens the kitchen door.",
    "A good essay has a clear question, a careful argument and an honest conclusion.",
    "The river flooded the fields in spring, and the farmers waited for the ground to dry.",
    "Please send me the report by Friday; I would like to read it before the meeting.",
    "In 1969, two astronauts walked on the Moon while a third orbited above them.",
    "She learned to play the piano as a child and still practises for an hour every evening.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and some warm milk.",
    "Computers store numbers in binary, using only the digits zero and one.",
    "The museum opens at nine o'clock and closes at five, except on Mondays.",
    "After the storm, the streets were covered with leaves and broken branches.",
    "If you want to learn a language, speak it every day, even if you make mistakes.",
    "The children built a small wooden boat and sailed it across the pond.",
    "Prices rose by three percent last year, mostly because of the cost of energy.",
    "The doctor told him to rest, drink plenty of water and come back in a week.",
    "Mountains cover much of the country, and most people live in the valleys near the coast.",
    "He wrote a short letter to his grandmother, thanking her for the birthday present.",
    "The software update fixed several bugs and made the program start twice as fast.",
    "On clear nights you can see thousands of stars, and sometimes a planet low in the west.",
    "The bakery on the corner sells fresh bread, croissants and apple pie every morning.",
    "Scientists measure the age of rocks by the slow decay of radioactive elements.",
    "Would you like tea or coffee? We also have orange juice and cold water.",
    "The old bridge was closed for repairs, so everyone drove the long way around the lake.",
    "Reading a map is easier when you know where north is and how far one centimetre reaches.",
    "Lions live in groups called prides, and the females do most of the hunting.",
    "The teacher asked the students to write three sentences about their summer holidays.",
    "A healthy breakfast gives you energy for the whole morning.",
    "The company hired twenty new engineers to build its next generation of products.",
    "When the music started, everybody stood up and began to dance.",
]
CALIBRATION_CHATS = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("Can you give me a tip for sleeping better?",
     "Try to go to bed at the same time every night and keep your bedroom dark and quiet."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Write a short poem about rain.",
     "Soft rain on the roof,\nthe garden drinks in silence,\ngrey clouds drifting by."),
    ("Explain what a noun is.",
     "A noun is a word that names a person, a place, a thing or an idea, like 'teacher' or 'city'."),
    ("What is 12 plus 30?", "12 plus 30 is 42."),
    ("Give me two ideas for a weekend trip.",
     "You could go hiking in the hills nearby, or visit a small town you have never seen before."),
    ("Why do leaves change colour in autumn?",
     "As the days get shorter, trees stop making chlorophyll, and the yellow and red pigments show through."),
]
TEXTS_PER_SEQUENCE = 8  # plain sentences joined into passages of ~150-200 tokens (positions as in real use)


def calibration_token_ids(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of the calibration set: the plain texts in passages of ``TEXTS_PER_SEQUENCE``
    sentences, then each chat turn through the tokenizer's chat template (when it has one). Without
    a tokenizer: 8 fixed pseudo-random sequences of 128 ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (128,), generator=g).tolist() for _ in range(8)]
    seqs = [tokenizer.encode(" ".join(CALIBRATION_TEXTS[i:i + TEXTS_PER_SEQUENCE]))
            for i in range(0, len(CALIBRATION_TEXTS), TEXTS_PER_SEQUENCE)]
    if getattr(tokenizer, "chat_template", None):
        for q, a in CALIBRATION_CHATS:
            try:
                turn = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                text = tokenizer.apply_chat_template(turn, tokenize=False)
            except Exception:  # noqa: BLE001 - a template that wants other roles: the plain texts suffice
                continue
            seqs.append(tokenizer.encode(text, add_special_tokens=False))
    return [[t for t in s if 0 <= t < vocab_size] for s in seqs if s]


@torch.inference_mode()
def collect_input_amax(model: nn.Module, seqs: Sequence[Sequence[int]], modules: Sequence[nn.Module]
                       ) -> dict[nn.Module, torch.Tensor]:
    """Per-input-channel max |x| (float32 [in_features per rank]) of each module in ``modules`` over
    one KV-cache-less forward pass of ``model`` on ``seqs`` (each sequence a prefill of its own)."""
    stats: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, x: torch.Tensor) -> None:
        a = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        prev = stats.get(module)
        stats[module] = a if prev is None else torch.maximum(prev, a)

    device = next(model.parameters()).device
    handles = [m.register_forward_pre_hook(lambda mod, args: record(mod, args[0])) for m in modules]
    # The CPU layer runner (platforms/cpu/layer_runner.py) has no hooks, and it must judge the model once its
    # linears are quantized and packed, not before: the loop runs this pass.
    runner_was = model.__dict__.get("use_cpu_layer_runner")
    try:
        model.use_cpu_layer_runner = False
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)
        prefills, start = [], 0
        for s in seqs:
            prefills.append(PrefillSeq(start, start + len(s), len(s)))
            start += len(s)
        meta = AttentionMetadata(slot_mapping=torch.arange(start, device=device), prefills=prefills)
        _forward_stage(model, ids, positions, meta)
    finally:
        for h in handles:
            h.remove()
        if runner_was is None:
            model.__dict__.pop("use_cpu_layer_runner", None)
        else:
            model.use_cpu_layer_runner = runner_was
    return stats


def _forward_stage(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> None:
    """One forward pass without a KV cache; under pipeline parallelism this stage's part of it:
    the previous stage's (hidden states, residual stream) in, this stage's out to the next, as
    ``worker/pp_runner.py`` does for a step (stages load, and so calibrate, at the same time)."""
    rank, size = get_pp_rank(), get_pp_size()
    if size == 1:
        model(ids, positions, [None] * len(model.layers), meta)
        return
    shape = (ids.shape[0], model.config.hidden_size)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    inter = None if rank == 0 else tuple(pp_recv(shape, dtype, ids.device, rank - 1) for _ in range(2))
    out = model(ids, positions, [None] * len(model.layers), meta, intermediate=inter)
    if rank < size - 1:
        for t in out:
            pp_send(t, rank + 1)


def smoothable_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers with the Llama structure SmoothQuant folds into: plain RMSNorms before a fused
    qkv_proj and before a dense SwiGLU MLP (the attention part alone when the MLP is sparse)."""
    return [layer for layer in getattr(model, "layers", [])
            if isinstance(layer, LlamaDecoderLayer) and type(layer.input_layernorm) is RMSNorm
            and getattr(getattr(layer.self_attn, "qkv_proj", None), "weight", None) is not None]  # (not MLA's)


def smooth_model(model: nn.Module, stats: dict[nn.Module, torch.Tensor], alpha: float) -> int:
    """Fold the smoothing factors computed from ``stats`` (``collect_input_amax``) into the float
    weights of every smoothable layer; returns the number of linear inputs smoothed."""
    count = 0
    for layer in smoothable_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        smooth_norm_into(layer.input_layernorm, attn.qkv_proj, stats[attn.qkv_proj], alpha)
        smooth_attention_output(attn, stats[attn.o_proj], alpha)
        count += 2
        if isinstance(mlp, LlamaMLP) and type(layer.post_attention_layernorm) is RMSNorm:
            smooth_norm_into(layer.post_attention_layernorm, mlp.gate_up_proj, stats[mlp.gate_up_proj], alpha)
            smooth_mlp(mlp, stats[mlp.down_proj], alpha)
            count += 2
    return count


def calibration_modules(model: nn.Module) -> list[nn.Module]:
    """The linears whose inputs the calibration records: each smoothable layer's qkv_proj and o_proj,
    and its gate_up_proj and down_proj when the MLP is dense."""
    mods: list[nn.Module] = []
    for layer in smoothable_layers(model):
        mods += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if isinstance(layer.mlp, LlamaMLP):
            mods += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return mods


@dataclass
class SmoothingReport:
    """What ``apply_smoothquant`` did, for the loader's quantization log line (``describe``)."""

    alpha: float
    num_smoothed: int  # linear inputs smoothed
    num_tokens: int  # calibration tokens
    seconds: float

    def describe(self) -> str:
        return (f"SmoothQuant alpha={self.alpha:g} on {self.num_smoothed} linear inputs "
                f"(calibrated on {self.num_tokens} tokens in {self.seconds:.1f} s)")


def apply_smoothquant(model: nn.Module, tokenizer: Any, alpha: float) -> Optional[SmoothingReport]:
    """Calibrate ``model`` (float weights, as loaded; one pipeline stage of it under pipeline
    parallelism, every stage calling this at once) and fold the factors in. None when the model has
    no smoothable layer."""
    modules = calibration_modules(model)
    if not modules:
        return None
    start = time.perf_counter()
    seqs = calibration_token_ids(tokenizer, model.config.vocab_size)
    stats = collect_input_amax(model, seqs, modules)
    count = smooth_model(model, stats, alpha)
    return SmoothingReport(alpha, count, sum(len(s) for s in seqs), time.perf_counter() - start)


def smooth_for_quantization(model: nn.Module, quant_config: Any, tokenizer_path: Optional[str]
                            ) -> Optional[SmoothingReport]:
    """The loader's step before the linear methods process their weights: smooth when the
    quantization config asks for it (``smooth_alpha``, or ``PAGEDLLM_SMOOTHQUANT_ALPHA``).
    The tokenizer comes from ``tokenizer_path`` (pseudo-random ids when none can be loaded)."""
    if quant_config is None:
        return None
    alpha = smoothquant_alpha(getattr(quant_config, "smooth_alpha", None))
    if alpha is None:
        return None
    tokenizer = None
    if tokenizer_path:
        try:
            tokenizer = load_tokenizer(tokenizer_path)
        except ValueError:
            logger.info("SmoothQuant: no tokenizer at %s; calibrating on fixed pseudo-random token ids",
                        tokenizer_path)
    return apply_smoothquant(model, tokenizer, alpha)
