"""Config folders of real model shapes, to run with ``--load-format dummy`` (random weights).

``--model shape:qwen2-0.5b`` in any bench writes (once) a folder with a Qwen2-0.5B-shaped
``config.json`` and a small byte-level BPE tokenizer (1,024 trained tokens; the rest of the model's
vocabulary decodes to placeholder words `` t<id>``). The benches pass prompts as token ids and force
output lengths, so the tokenizer only matters for streaming and detokenization cost.

    python -m pagedllm.benchmarks.model_shapes OUT_DIR [--shape qwen2-0.5b] [--save-random-weights]

``--save-random-weights`` also saves transformers' random init (seed 0, float32 safetensors), for
engines that need weight files (llama.cpp's HF-to-GGUF converter, OpenVINO's exporter).
"""
from __future__ import annotations

import argparse
import json
import os
import random
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SHAPES: dict[str, dict] = {
    # Qwen/Qwen2-0.5B: 494M parameters (136M of them the tied embedding).
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # Qwen/Qwen2.5-1.5B: 1.54B parameters (233M of them the tied embedding), GQA 12/2.
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # meta-llama/Meta-Llama-3-8B: 8.03B parameters (untied 128,256-token embedding and LM head), GQA 32/8.
    "llama-3-8b": dict(arch="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
    # Issue 10's random Llama (33.6M parameters): the CPU comparison with llama.cpp and OpenVINO.
    "llama-33m": dict(arch="llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1536, vocab_size=8192, tie_word_embeddings=False,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
    # A small Llama for quick checks of the bench itself.
    "llama-tiny": dict(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=4096, tie_word_embeddings=False,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
}

# Image-text shapes (``pagedllm bench images``): a Qwen2-VL config (language model + vision tower), the
# tokenizer with Qwen's vision tokens and the image processor's preprocessor_config.json.
VISION_SHAPES: dict[str, dict] = {
    # Qwen/Qwen2-VL-2B-Instruct: a Qwen2-1.5B-shaped language model, a 675M-parameter ViT (32 blocks of 1280).
    "qwen2-vl-2b": dict(text=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                  num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536),
                        tie_word_embeddings=True),
    # A small one for quick checks of the bench itself.
    "qwen2-vl-tiny": dict(text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=4096, max_position_embeddings=2048,
                                    rms_norm_eps=1e-6, rope_theta=10000.0,
                                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                          vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64),
                          tie_word_embeddings=False),
}
_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

_WORDS = ("the of and to in is was he for it with as his on be at by had are but from or have an they which one "
          "you were her all she there would their we him been has when who will more no if out so said what up its "
          "about into than them can only other new some could time these two may then do first any my now such like "
          "king queen lord thou thee thy romeo juliet night day love death sweet fair").split()


def build_tokenizer(out_dir: str, model_vocab_size: int, bpe_vocab_size: int = 1024, extra_special=()):
    """A byte-level BPE tokenizer (every string encodes) trained on a seeded word corpus, its
    vocabulary padded to ``model_vocab_size`` with tokens `` t<id>`` that encoding never produces
    but that decode to text, so every id a random-weight model samples shows up in a stream.
    ``extra_special``: more special tokens (an image-text model's)."""
    from transformers import PreTrainedTokenizerFast  # lazily: transformers, ~1 s to import

    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 15))) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(bpe_vocab_size, model_vocab_size),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(tok.get_vocab_size(), model_vocab_size):
        vocab[f"\u0120t{i}"] = i  # "\u0120" is the byte-level alphabet's space
    tok = Tokenizer.from_str(json.dumps(data))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def write_model_shape(out_dir: str, shape: str = "qwen2-0.5b") -> str:
    """Write ``config.json`` (+ tokenizer) of ``shape`` into ``out_dir`` unless it is already there
    (``shape.json`` records what was written)."""
    import transformers  # lazily: transformers, ~1 s to import

    if shape in VISION_SHAPES:
        return write_vision_shape(out_dir, shape)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join([*SHAPES, *VISION_SHAPES])}")
    stamp = {"shape": shape, "spec": SHAPES[shape], "tokenizer": "bpe1024+padded-v2"}
    if _written(out_dir, stamp):
        return out_dir
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    tok = build_tokenizer(out_dir, spec["vocab_size"])
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    config = cls(**spec, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id, architectures=[{"qwen2": "Qwen2ForCausalLM",
                                                                "llama": "LlamaForCausalLM"}[arch]])
    config.save_pretrained(out_dir)
    _mark(out_dir, stamp)
    return out_dir


def resolve_model(model: Optional[str], load_format: str, output_dir: str) -> tuple[Optional[str], str]:
    """``shape:NAME`` -> (written config folder, "dummy"); anything else is returned as is."""
    if model and model.startswith("shape:"):
        name = model.split(":", 1)[1]
        path = write_model_shape(os.path.join(output_dir, "models", name), name)
        return path, "dummy"
    return model, load_format


def _written(out_dir: str, stamp: dict) -> bool:
    """Whether ``out_dir`` holds what ``stamp`` describes (its ``shape.json``); else the folder is made."""
    marker = os.path.join(out_dir, "shape.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == stamp:
                return True
    os.makedirs(out_dir, exist_ok=True)
    return False


def _mark(out_dir: str, stamp: dict) -> None:
    with open(os.path.join(out_dir, "shape.json"), "w") as f:
        json.dump(stamp, f)


def write_vision_shape(out_dir: str, shape: str) -> str:
    """A Qwen2-VL config folder of ``shape`` (VISION_SHAPES): config.json, tokenizer with the vision
    tokens, preprocessor_config.json (transformers' defaults: 14-pixel patches merged 2 x 2), unless there."""
    import transformers  # lazily: transformers, ~1 s to import
    # lazily: transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    stamp = {"shape": shape, "spec": VISION_SHAPES[shape], "tokenizer": "bpe1024+padded-v2+vision"}
    if _written(out_dir, stamp):
        return out_dir
    spec = VISION_SHAPES[shape]
    tok = build_tokenizer(out_dir, spec["text"]["vocab_size"], extra_special=_VISION_TOKENS)
    ids = dict(zip(["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"],
                   tok.convert_tokens_to_ids(_VISION_TOKENS)))
    text = dict(spec["text"], bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=spec["tie_word_embeddings"])
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=spec["vision"],
                                        tie_word_embeddings=spec["tie_word_embeddings"],
                                        architectures=["Qwen2VLForConditionalGeneration"], **ids)
    config.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil().save_pretrained(out_dir)
    _mark(out_dir, stamp)
    return out_dir


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    p.add_argument("--save-random-weights", action="store_true",
                   help="also save random float32 weights (transformers' init, seed 0) as safetensors")
    a = p.parse_args(argv)
    out = write_model_shape(a.out_dir, a.shape)
    if a.save_random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM  # lazily: transformers, ~1 s to import

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
        model.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
