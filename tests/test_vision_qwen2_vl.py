"""Qwen2-VL / Qwen2.5-VL building blocks against transformers' own modules on tiny random configs
(fp32): the vision transformer + patch merger (pagedllm/models/qwen2_vl_vision.py) and M-RoPE
(pagedllm/layers/mrope.py: the rotary table per stream, get_rope_index's positions and delta)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from pagedllm.layers.mrope import (mrope_channel_streams, mrope_cos_sin, mrope_input_positions,  # noqa: E402
                                   mrope_positions_at)
from pagedllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from pagedllm.models.qwen2_vl_vision import Qwen2VisionTransformer, window_index  # noqa: E402

IMAGE_TOKEN = 7


def _vision_config(version: str, **kw):
    common = dict(depth=3, num_heads=2, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if version == "2":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        return Qwen2VLVisionConfig(embed_dim=32, hidden_size=48, mlp_ratio=2, hidden_act="quick_gelu", **common, **kw)
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    return Qwen2_5_VLVisionConfig(hidden_size=32, out_hidden_size=48, intermediate_size=40, hidden_act="silu",
                                  window_size=56, fullatt_block_indexes=[1], **common, **kw)


def _hf_tower(version: str, cfg):
    if version == "2":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as cls
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls._from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _pixels(sizes, seed=0):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64, patch_size=14, merge_size=2)
    out = proc(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_vision_tower_equals_transformers(version):
    cfg = _vision_config(version)
    hf = _hf_tower(version, cfg)
    ours = Qwen2VisionTransformer(cfg, torch.float32)
    # the checkpoint names of Qwen2VLForConditionalGeneration (model.visual.*); a language-model tensor is skipped
    loaded = ours.load_weights([("model.visual." + k, v) for k, v in hf.state_dict().items()]
                               + [("model.language_model.norm.weight", torch.ones(3))])
    assert loaded == set(dict(ours.named_parameters()))
    # a wide and a tall image (partial windows of 2x2 merged tokens in Qwen2.5-VL) and a small one
    pixels, grid = _pixels([(140, 250), (230, 110), (30, 40)])
    assert grid.tolist() == [[1, 10, 18], [1, 16, 8], [1, 2, 2]]
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert got.shape == want.shape == (sum(ours.split_sizes(grid)), 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one image at a time gives the same rows (attention never crosses an image)
    with torch.no_grad():
        first = ours(pixels[:180], grid[:1])
    torch.testing.assert_close(first, got[:45], rtol=1e-5, atol=1e-5)


def test_window_index_equals_transformers():
    from transformers.vision_utils import get_vision_window_index
    grid = torch.tensor([[1, 10, 18], [2, 8, 8], [1, 2, 2]])
    order, lengths = window_index(grid.tolist(), 2, 2)
    want_order, want_cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=56, patch_size=14)
    assert order.tolist() == want_order.tolist()
    assert np.cumsum([0] + lengths).tolist() == want_cu.tolist()


def test_vision_weights_missing_is_an_error():
    cfg = _vision_config("2")
    ours = Qwen2VisionTransformer(cfg, torch.float32)
    with pytest.raises(ValueError, match="missing vision weights"):
        ours.load_weights([("visual.merger.ln_q.weight", torch.ones(32))])


# ------------------------------------------------------------------------------------------ M-RoPE

def _hf_vl_model(version: str):
    if version == "2":
        from transformers import Qwen2VLConfig as C
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as M
    else:
        from transformers import Qwen2_5_VLConfig as C
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as M
    vision = _vision_config(version).to_dict()
    text = dict(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 2]})
    cfg = C(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=8)
    return M(cfg).eval(), cfg


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_mrope_positions_equal_get_rope_index(version):
    model, cfg = _hf_vl_model(version)
    grids = [[1, 4, 6], [1, 8, 2]]  # 6 and 4 image tokens
    ids = [1, 2, 3] + [IMAGE_TOKEN] * 6 + [4, 5] + [IMAGE_TOKEN] * 4 + [6, 9, 10, 11]
    want, want_delta = model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN)
                                            .int(), image_grid_thw=torch.tensor(grids))
    got, delta = mrope_input_positions(ids, IMAGE_TOKEN, grids, 2)
    assert got.tolist() == want[:, 0].tolist()
    assert delta == int(want_delta) and delta < 0
    # decode: index i >= L at i + delta on all three streams (transformers' cache_position + rope_deltas)
    assert mrope_positions_at(got, delta, len(ids), len(ids) + 2).tolist() == \
        [[len(ids) + delta, len(ids) + delta + 1]] * 3
    # a chunk across the prompt's end
    chunk = mrope_positions_at(got, delta, 15, len(ids) + 1)
    assert chunk[:, :-1].tolist() == got[:, 15:].tolist() and chunk[:, -1].tolist() == [len(ids) + delta] * 3
    # text alone: plain positions, delta 0
    text, d0 = mrope_input_positions([1, 2, 3], IMAGE_TOKEN, [], 2)
    assert text.tolist() == [[0, 1, 2]] * 3 and d0 == 0


def test_mrope_positions_bad_prompts():
    with pytest.raises(ValueError, match="needs 6 consecutive image tokens"):
        mrope_input_positions([1] + [IMAGE_TOKEN] * 5 + [2], IMAGE_TOKEN, [[1, 4, 6]], 2)
    with pytest.raises(ValueError, match="not 2"):
        mrope_input_positions([1] + [IMAGE_TOKEN] * 6, IMAGE_TOKEN, [[1, 4, 6], [1, 2, 2]], 2)
    with pytest.raises(ValueError, match="more image tokens"):
        mrope_input_positions([IMAGE_TOKEN], IMAGE_TOKEN, [], 2)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_mrope_cos_sin_equals_transformers(version):
    model, cfg = _hf_vl_model(version)
    rotary_hf = model.language_model.rotary_emb
    head_dim = 24
    table = RotaryEmbedding(head_dim, 128, {"rope_theta": cfg.text_config.rope_parameters["rope_theta"]},
                            torch.float32)
    streams = mrope_channel_streams([4, 6, 2], head_dim)
    positions, _ = mrope_input_positions([1, 2] + [IMAGE_TOKEN] * 6 + [3], IMAGE_TOKEN, [[1, 4, 6]], 2)
    cos, sin = rotary_hf(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    got = mrope_cos_sin(table, positions, streams)
    assert got.shape == (9, 2, 1, head_dim)
    half = head_dim // 2
    signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    torch.testing.assert_close(got[:, 0, 0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, 1, 0], signed, rtol=1e-6, atol=1e-6)
    # plain positions: the plain table
    assert torch.equal(mrope_cos_sin(table, positions[0], streams), table.cos_sin(positions[0]))
    with pytest.raises(ValueError, match="adds up to"):
        mrope_channel_streams([4, 6, 4], head_dim)
