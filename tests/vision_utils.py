"""Tiny random-weight image-text checkpoints for the vision tests, built with transformers' config
and model classes and the real processor classes, a BPE tokenizer (``tokenizers``) with the family's
image tokens, and images drawn with PIL. Nothing is downloaded."""
from __future__ import annotations

import base64
import io
import random

import torch
import transformers
from PIL import Image, ImageDraw

from conftest import corpus

LLAVA_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
                       "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
                       "{% else %}<image>{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GEMMA3_CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE.replace("<image>", "<start_of_image>")


def build_tokenizer(out_dir: str, extra: list[str], template: str, vocab_size: int = 400, named=None):
    """A byte-level BPE tokenizer whose special tokens include ``extra`` (the image tokens); ``named``:
    model-specific special tokens by attribute name (Gemma 3's boi_token, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>", "<|user|>",
                                                                         "<|assistant|>", "<|system|>", *extra],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(4000).split("\n"), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", extra_special_tokens=named or None)
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    return fast


def _text_config(tok, **kw) -> dict:
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                initializer_range=0.15, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, **kw)


def _randomize(model, seed: int) -> None:
    """Random values where transformers initializes constants (biases, norms, embeddings at 0), so
    that every weight matters to the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or "embedding" in name or "projection" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if name.endswith("norm.weight")
                                                                     and "soft_emb" not in name else 0.0))


def build_llava(d: str, seed: int = 0, tower: str = "clip"):
    """(transformers model, processor) of a tiny LLaVA (CLIP 28x28, patch 14 -> 4 image tokens, Llama), or
    with ``tower="siglip"`` LLaVA-Interleave's layout (SigLIP, a Qwen2 language model, all patches)."""
    tok = build_tokenizer(d, ["<image>"], LLAVA_CHAT_TEMPLATE)
    vision = dict(model_type=f"{tower}_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14)
    siglip = tower == "siglip"
    text = _text_config(tok, model_type="qwen2" if siglip else "llama")
    config = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                      image_token_index=tok.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-1 if siglip else -2,
                                      vision_feature_select_strategy="full" if siglip else "default",
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.save_pretrained(d)
    ip = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    if siglip:
        ip = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    proc = transformers.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                                       vision_feature_select_strategy=config.vision_feature_select_strategy,
                                       num_additional_image_tokens=0 if siglip else 1,
                                       image_token="<image>", chat_template=LLAVA_CHAT_TEMPLATE)
    proc.save_pretrained(d)
    return model, proc


def build_gemma3(d: str, seed: int = 0):
    """(transformers model, processor) of a tiny Gemma 3 (SigLIP 28x28, patch 7 -> 16 patches pooled to
    4 image tokens, Gemma 3 text)."""
    extra = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok = build_tokenizer(d, extra, GEMMA3_CHAT_TEMPLATE,  # (Gemma3Processor reads them off its tokenizer)
                          named=dict(zip(("boi_token", "eoi_token", "image_token"), extra)))
    text = _text_config(tok, sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=False)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=tok.convert_tokens_to_ids(extra[0]),
                                       eoi_token_index=tok.convert_tokens_to_ids(extra[1]),
                                       image_token_index=tok.convert_tokens_to_ids(extra[2]),
                                       initializer_range=0.15, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.save_pretrained(d)
    ip = transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28})
    proc = transformers.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                                        chat_template=GEMMA3_CHAT_TEMPLATE)
    proc.save_pretrained(d)
    return model, proc


def make_image(seed: int, size: tuple[int, int] = (40, 32)) -> Image.Image:
    """A random picture: a colored background and a few rectangles and ellipses."""
    rng = random.Random(seed)
    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(size[0]), rng.randrange(size[1])
        box = [x0, y0, x0 + rng.randrange(4, 20), y0 + rng.randrange(4, 20)]
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=fill)
    return img


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def hf_generate(model, proc, text: str, images: list, n: int) -> list[int]:
    """transformers' greedy ``generate`` on the processor's inputs: the new token ids."""
    inputs = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
