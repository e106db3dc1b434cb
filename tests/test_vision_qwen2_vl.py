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
    ours.load_weights([("model.visual." + k, v) for k, v in hf.state_dict().items()]
                      + [("model.language_model.norm.weight", torch.ones(3))])
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
    with pytest.raises(ValueError, match="missing weights"):
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


# ------------------------------------------------------------------ the engine against transformers' generate

MAX_NEW = 8
PH = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL's chat template writes each image part as PH (the rest is the test tokenizer's simple template)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
                 "{% else %}" + PH + "{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_vl_checkpoint(out_dir: str, version: str, seed: int = 0, **text_overrides) -> str:
    """A tiny random Qwen2-VL / Qwen2.5-VL checkpoint (language model, vision tower, image processor config,
    tokenizer with Qwen's vision tokens) saved with save_pretrained."""
    from conftest import build_tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                         "<|video_pad|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    ids = dict(zip(["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"],
                   tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])))
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rope_scaling={"type": "mrope",
                                                                                   "mrope_section": [2, 3, 3]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False, initializer_range=0.15)
    text.update(text_overrides)
    vision = _vision_config(version).to_dict()
    vision["out_hidden_size" if version == "2.5" else "hidden_size"] = text["hidden_size"]
    if version == "2":
        from transformers import Qwen2VLConfig as C, Qwen2VLForConditionalGeneration as M
    else:
        from transformers import Qwen2_5_VLConfig as C, Qwen2_5_VLForConditionalGeneration as M
    config = C(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    model = M(config).eval()
    with torch.no_grad():  # transformers zero-initializes biases and sets norms to 1: random ones show up
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 20).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["2", "2.5"])
def vl_checkpoint(request, tmp_path_factory):
    d = build_vl_checkpoint(str(tmp_path_factory.mktemp(f"qwen{request.param}vl")), request.param)
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    return d, model


def _images(seed: int, sizes=((60, 90), (100, 45))):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_generate(d: str, model, text: str, images: list) -> list[int]:
    """transformers' greedy generate on the prompt our processor expands (the same ids, pixels and grids)."""
    from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTower
    proc = Qwen2VLVisionTower.make_processor(d, model.config)
    if images:
        inputs = proc(text, images)
        ids = inputs["input_ids"]
        extra = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    else:
        ids, extra = proc.tokenizer([text], return_tensors="pt")["input_ids"], {}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                         max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_with_images_equals_transformers(vl_checkpoint):
    d, model = vl_checkpoint
    imgs = _images(0) + _images(1, ((50, 50),))
    prompts = [
        (f"Describe {PH} briefly please", [imgs[0]]),
        (f"one {PH} and two {PH} compared", [imgs[1], imgs[2]]),
        ("text only, no image here at all", []),
        (f"{PH}{PH} back to back", [imgs[2], imgs[0]]),
    ]
    assert engine_greedy(d, prompts) == [hf_generate(d, model, t, ims) for t, ims in prompts]


def engine_greedy(d: str, prompts: list[tuple[str, list]]) -> list[list[int]]:
    """Greedy ids of (text, images) prompts in one batch (fp32); asserts the outputs are not degenerate
    and every block is back in the pool."""
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams
    llm = LLM(d, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts], sp,
                        use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert len({t for g in got for t in g}) > 4  # not a degenerate model
    assert_pool_empty(llm)
    return got


def _prompt_of_length(d: str, model, images: list, n: int, seed: int) -> str:
    """A prompt with ``images`` (each placeholder after some words) whose expanded ids are n tokens or one more."""
    from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTower
    proc = Qwen2VLVisionTower.make_processor(d, model.config)
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "image", "shows", "a", "red", "blue", "house", "near", "river", "and", "tree"]
    head = " ".join(f"w{i} {PH}" for i in range(len(images)))
    text = head
    while proc(text + " x", images)["input_ids"].shape[1] <= n:
        text += " " + words[int(rng.integers(len(words)))]
    return text


def test_chunked_prefill_preemption_prefix_caching_with_images(vl_checkpoint, monkeypatch):
    from conftest import assert_pool_empty, record_schedule
    from pagedllm import LLM, SamplingParams
    d, model = vl_checkpoint
    imgs = _images(2) + _images(3)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # three ~45-token prompts (3 blocks of 16 each) in 8 blocks: each needs a 4th block to decode -> preemption;
    # 16-token chunks (an image is never split: its tokens wait for the next chunk)
    prompts = [(_prompt_of_length(d, model, ims, 44, i), ims) for i, ims in
               enumerate([[imgs[0]], [imgs[1], imgs[2]], [imgs[3]]])]
    want = [hf_generate(d, model, t, ims) for t, ims in prompts]
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(d, dtype="float32", kv_cache_memory=8 * per_block, max_model_len=128, max_num_batched_tokens=16)
    log = record_schedule(llm, monkeypatch)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert len([1 for _, done, n, total in log if done + n < total]) >= 6  # chunked
    assert_pool_empty(llm)

    # prefix caching: a prompt sharing 2+ blocks of text with another, then a different image, shares the
    # text's blocks only (each answer is its own image's); an image seen again behind other text is not
    # encoded again (the encoder cache), and the prompt seen again whole is a prefix-cache hit
    enc, pool = llm.llm_engine.input_batch.encoder_cache, llm.llm_engine.scheduler
    shared = "the cat image shows a red blue house near the river and a tree " * 3
    before = enc.hits
    for i, (text, ims) in enumerate(((shared + PH + " tell me", [imgs[1]]), (shared + PH + " tell me", [imgs[0]]),
                                     ("now " + PH + " again", [imgs[1]]), (shared + PH + " tell me", [imgs[0]]))):
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": ims}}], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_generate(d, model, text, ims)
        if i in (1, 3):  # the shared text's blocks (i = 1), the whole prompt's but its last token (i = 3)
            assert out.num_cached_tokens >= (32 if i == 1 else (len(out.prompt_token_ids) - 1) // 16 * 16)
    assert enc.hits > before
    assert_pool_empty(llm)


def test_chat_with_image_parts_equals_generate(vl_checkpoint):
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams
    d, model = vl_checkpoint
    img = _images(5)[1]
    llm = LLM(d, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                         {"type": "image_pil", "image_pil": img},
                                         {"type": "text", "text": "this picture?"}]}]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    chat = llm.chat(msgs, sp, use_tqdm=False)[0]
    text = f"<|user|>what is{PH}this picture?</s><|assistant|>"
    assert list(chat.outputs[0].token_ids) == hf_generate(d, model, text, [img])
    assert_pool_empty(llm)


def test_server_chat_with_an_image_equals_offline(tmp_path_factory):
    """Through `pagedllm serve` (engine core in its own process: the M-RoPE positions cross the core
    protocol with the image): a chat with a data: URL image answers as transformers does."""
    httpx = pytest.importorskip("httpx")
    from server_utils import RemoteServer
    from vision_utils import data_url
    d = build_vl_checkpoint(str(tmp_path_factory.mktemp("qwen25vl_server")), "2.5", seed=3)
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    img = _images(6)[0]
    want = hf_generate(d, model, f"<|user|>{PH}the king</s><|assistant|>", [img])
    assert len(set(want)) > 2
    tok = transformers.AutoTokenizer.from_pretrained(d)
    args = ("--served-model-name", "qwen-vl", "--max-model-len", "256", "--kv-cache-memory", "4MiB", "--dtype",
            "float32", "--disable-access-log")
    with RemoteServer(d, args, log_path=str(tmp_path_factory.mktemp("log") / "server.log")) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as h:
            r = h.post("/v1/chat/completions", json={
                "model": "qwen-vl", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                                          {"type": "text", "text": "the king"}]}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    assert srv.returncode == 0, srv.log()


def test_cpu_layer_runner_with_mrope_positions(tmp_path):
    """The CPU layer runner (all decoder layers in one C call) takes the M-RoPE table the model gathers:
    greedy ids with images equal transformers' with the runner on (a text width it packs for)."""
    from test_cpu_layer_runner import WIDE, _model, _runner_or_skip
    _runner_or_skip()
    d = build_vl_checkpoint(str(tmp_path), "2.5", seed=4, **{**WIDE, "head_dim": 64,
                                                             "rope_scaling": {"type": "mrope",
                                                                              "mrope_section": [8, 12, 12]}})
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    imgs = _images(7)
    prompts = [(f"Describe {PH} briefly please", [imgs[0]]), (f"one {PH} and two {PH} compared", imgs[:2]),
               ("text only, no image here at all", [])]
    from pagedllm import LLM, SamplingParams
    llm = LLM(d, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512)
    runner = _model(llm).__dict__.get("_cpu_layer_runner")
    before = runner.steps_run if runner else 0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts], sp,
                        use_tqdm=False)
    runner = _model(llm).__dict__.get("_cpu_layer_runner")
    assert runner is not None and runner.steps_run > before
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_generate(d, model, t, ims) for t, ims in prompts]


def _local_checkpoint(*globs: str):
    """A snapshot folder of a real checkpoint in the local Hugging Face cache matching one of ``globs``
    (``models--<owner>--<name>``), or None. Nothing is downloaded."""
    import glob
    import os
    root = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    for g in globs:
        for snap in sorted(glob.glob(os.path.join(root, g, "snapshots", "*"))):
            if os.path.exists(os.path.join(snap, "config.json")) and os.path.exists(
                    os.path.join(snap, "preprocessor_config.json")):
                return snap
    return None


@pytest.mark.parametrize("globs", [("models--Qwen--Qwen2-VL-*",), ("models--Qwen--Qwen2.5-VL-*",),
                                   ("models--mistralai--Mistral-Small-3.*", "models--mistralai--Ministral-3-*")])
def test_real_checkpoint_when_installed(globs):
    """A real Qwen2-VL / Qwen2.5-VL / Mistral 3 checkpoint from the local cache: greedy ids with a 448x448
    image equal transformers' (fp32). Skipped when none is installed (this machine downloads nothing)."""
    d = _local_checkpoint(*globs)
    if d is None:
        pytest.skip(f"no local checkpoint matching {globs} in the Hugging Face cache")
    from transformers import AutoConfig, AutoModelForImageTextToText
    from pagedllm.models.pixtral_vision import PixtralVisionTower
    from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTower
    cfg = AutoConfig.from_pretrained(d)
    tower = PixtralVisionTower if cfg.model_type == "mistral3" else Qwen2VLVisionTower
    proc = tower.make_processor(d, cfg)
    img = _images(8, ((448, 448),))[0]
    text = f"{proc.placeholder} What is in this picture?"
    inputs = proc(text, [img])
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    extra = {k: v for k, v in inputs.items() if k != "input_ids"}
    if cfg.model_type != "mistral3":
        extra["mm_token_type_ids"] = (inputs["input_ids"] == cfg.image_token_id).int()
    ids = inputs["input_ids"]
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    del model
    from pagedllm import LLM, SamplingParams
    llm = LLM(d, dtype="float32", max_model_len=1024)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [img]}}],
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want


def test_speculative_decoding_with_mrope(vl_checkpoint):
    """n-gram proposals of image requests verified at index + delta (and their prompt chunks' images in the
    verification batch beside other requests' proposals): the same ids as transformers."""
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams
    d, model = vl_checkpoint
    imgs = _images(9)
    rep = " the king and the queen and the king and the queen and the king and"
    prompts = [("the king and the queen and the king and the queen and the king and", []),
               (f"{PH}{rep}", [imgs[0]]), (f"one {PH} two {PH}{rep}", imgs[:2])]
    want = [hf_generate(d, model, t, ims) for t, ims in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(d, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512, speculative_config=spec,
              max_num_batched_tokens=24)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts], sp,
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    stats = llm.llm_engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert_pool_empty(llm)


def test_tensor_parallel_with_images(vl_checkpoint):
    """TP=2 (worker processes): the tower on each rank, M-RoPE positions and images in the step sent to both
    ranks; greedy ids with images equal transformers'."""
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams
    d, model = vl_checkpoint
    imgs = _images(10)
    prompts = [(f"Describe {PH} briefly please", [imgs[0]]), (f"one {PH} and two {PH} compared", imgs[:2]),
               ("text only, no image here at all", [])]
    llm = LLM(d, dtype="float32", tensor_parallel_size=2, kv_cache_memory=4 << 20, max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts], sp,
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_generate(d, model, t, ims) for t, ims in prompts]
    assert_pool_empty(llm)


def test_bad_qwen_image_inputs_and_the_engine_serves_on(vl_checkpoint):
    """Inputs Qwen's processing refuses: a ValueError naming why (a 400 through the server), then the engine
    answers a good prompt as before."""
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams
    d, _ = vl_checkpoint
    llm = LLM(d, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    img = _images(11)[0]
    good = {"prompt": f"Describe {PH} please", "multi_modal_data": {"image": img}}
    want = llm.generate(good, sp, use_tqdm=False)[0].outputs[0].token_ids
    thin = Image.new("RGB", (600, 2))  # aspect ratio over 200: Qwen2VLImageProcessor refuses it
    bad = [({"prompt": f"a {PH}", "multi_modal_data": {"image": thin}}, "aspect ratio"),
           ({"prompt": f"a {PH} b <|image_pad|>", "multi_modal_data": {"image": img}}, "placeholder"),
           ({"prompt": f"a {PH} {PH}", "multi_modal_data": {"image": img}}, "placeholder")]
    for prompt, why in bad:
        with pytest.raises(ValueError, match=why):
            llm.generate(prompt, sp, use_tqdm=False)
    assert llm.generate(good, sp, use_tqdm=False)[0].outputs[0].token_ids == want
    assert_pool_empty(llm)
