"""Mistral 3 (Pixtral vision encoder + patch-merging projector, models/pixtral_vision.py) against
transformers on a tiny random checkpoint (fp32): the image embeddings (allclose) and greedy ids with one
and two images, in a batch with a text-only prompt, equal to transformers' generate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from pagedllm.models.pixtral_vision import PixtralVisionTower  # noqa: E402

MAX_NEW = 8
SPECIAL = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def build_mistral3_checkpoint(out_dir: str, text_type: str = "mistral", seed: int = 0) -> str:
    from conftest import build_tokenizer
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = build_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(out_dir)
    img_id = tok.convert_tokens_to_ids("[IMG]")
    text = dict(model_type=text_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False, initializer_range=0.15, sliding_window=None)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, head_dim=16, patch_size=8, image_size=64, hidden_act="silu")
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=img_id, spatial_merge_size=2,
                            vision_feature_layer=-1, tie_word_embeddings=False, multimodal_projector_bias=True)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers sets norms to 1 and biases to 0: random ones show up
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out_dir)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["mistral", "ministral3"])
def mistral3(request, tmp_path_factory):
    """Mistral Small 3.1/3.2 (a Mistral language model) and Ministral 3 (a Ministral 3 one)."""
    from transformers import AutoModelForImageTextToText
    d = build_mistral3_checkpoint(str(tmp_path_factory.mktemp("mistral3")), request.param)
    return d, AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()


def _images(seed: int, sizes=((60, 90), (100, 45), (33, 33))):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_image_embeddings_equal_transformers(mistral3):
    from pagedllm.models.loader import iterate_weights
    d, model = mistral3
    proc = PixtralVisionTower.make_processor(d, model.config)
    out = proc("a [IMG] b [IMG] c [IMG]", _images(0))
    tower = PixtralVisionTower(model.config, torch.float32)
    tower.load_weights(iterate_weights(d))
    items = PixtralVisionTower.split_items(out, 3)
    got = [e for it in items for e in tower.encode([it])]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                                              vision_feature_layer=-1).pooler_output
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # the placeholder spans: [IMG] x columns + [IMG_BREAK] per row, [IMG_END] last; only [IMG] takes rows
    ids = out["input_ids"][0].tolist()
    ranges = PixtralVisionTower.placeholder_ranges(model.config, ids, items)
    assert [sum(e) for _, _, e in ranges] == [g.shape[0] for g in got]
    end = proc.tokenizer.convert_tokens_to_ids("[IMG_END]")
    assert all(ids[o + n - 1] == end for o, n, _ in ranges)


def hf_generate(d: str, model, text: str, images: list) -> list[int]:
    proc = PixtralVisionTower.make_processor(d, model.config)
    if images:
        inputs = proc(text, images)
        extra = dict(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
        ids = inputs["input_ids"]
    else:
        ids, extra = proc.tokenizer([text], return_tensors="pt")["input_ids"], {}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=MAX_NEW,
                         min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_with_images_equals_transformers(mistral3):
    from test_vision_qwen2_vl import engine_greedy
    d, model = mistral3
    imgs = _images(1)
    prompts = [("Describe [IMG] briefly please", [imgs[0]]),
               ("one [IMG] and two [IMG] compared", [imgs[1], imgs[2]]),
               ("text only, no image here at all", [])]
    assert engine_greedy(d, prompts) == [hf_generate(d, model, t, ims) for t, ims in prompts]
