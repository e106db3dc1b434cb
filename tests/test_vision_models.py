"""Image input, end to end offline, on tiny random-weight LLaVA (LlavaForConditionalGeneration: CLIP +
projector + Llama) and Gemma 3 (Gemma3ForConditionalGeneration: SigLIP + projector + Gemma 3 text)
checkpoints built here with transformers and the real processor classes: greedy ids with one and
two images equal transformers' ``generate`` on the processor's inputs (fp32), in one batch with
text-only requests, through chunked prefill (an image never split),
prefix caching (on == off with different images behind the same text) and the encoder cache (a
repeated image is not encoded again, counted); every block back in the pool afterwards."""
from __future__ import annotations

import pytest

from conftest import assert_pool_empty, record_schedule
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from vision_utils import build_gemma3, build_llava, hf_generate, make_image

N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
BUILDERS = {"llava": (build_llava, "<image>"), "gemma3": (build_gemma3, "<start_of_image>")}


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tmp_path_factory):
    """(name, checkpoint dir, transformers model, processor, image placeholder)."""
    build, mark = BUILDERS[request.param]
    d = str(tmp_path_factory.mktemp(request.param))
    model, proc = build(d)
    return request.param, d, model, proc, mark


def prompts(mark: str) -> list[tuple[str, list]]:
    """(prompt text, images) cases: one image, two images, an image mid-text, text only."""
    a, b, c = make_image(1), make_image(2, (56, 40)), make_image(3, (28, 28))
    return [(f"<|user|>{mark}the king and<|assistant|>", [a]),
            (f"<|user|>{mark}the king{mark} and the queen<|assistant|>", [a, b]),
            (f"<|user|>what is in{mark} this picture?<|assistant|>", [c]),
            ("<|user|>the queen of the world<|assistant|>", [])]


def engine_prompt(text: str, images: list):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def expected(model, proc, cases) -> list[list[int]]:
    return [hf_generate(model, proc, text, images or None, N) for text, images in cases]


def test_greedy_equals_transformers_in_one_batch(family):
    name, d, model, proc, mark = family
    cases = prompts(mark)
    want = expected(model, proc, cases)
    assert len({tuple(w) for w in want}) == len(want)  # the images and texts matter
    llm = LLM(d, kv_cache_memory=4 << 20)
    outs = llm.generate([engine_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert outs[0].prompt_token_ids == proc(text=[cases[0][0]], images=cases[0][1],
                                            return_tensors="pt")["input_ids"][0].tolist()
    assert_pool_empty(llm)


def test_chunked_prefill_keeps_an_image_whole(family, monkeypatch):
    name, d, model, proc, mark = family
    cases = prompts(mark)[:3]
    want = expected(model, proc, cases)
    llm = LLM(d, kv_cache_memory=4 << 20, max_num_batched_tokens=6, max_num_seqs=2, enable_prefix_caching=False)
    log = record_schedule(llm, monkeypatch)
    outs = llm.generate([engine_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    spans = {}
    engine = llm.llm_engine
    for o in outs:  # every image's placeholder span lies inside one scheduled chunk
        mm = engine.preprocess_prompt(engine_prompt(*cases[int(o.request_id)]))[2]
        spans[o.request_id] = [(f.offset, f.offset + f.length) for f in mm.features]
    chunks = [(rid, start, start + n) for rid, start, n, prompt_len in log if start < prompt_len]
    assert any(e - s < 6 for _, s, e in chunks)  # chunks were cut short to keep an image whole
    for rid, s, e in chunks:
        for lo, hi in spans[rid]:
            assert not (s < hi and lo < e) or (s <= lo and hi <= e), (rid, s, e, lo, hi)
    assert_pool_empty(llm)


def test_prefix_caching_different_images_behind_the_same_text(family):
    """The same text with another image must not reuse the first image's blocks: prefix caching on
    gives what it gives off, and the block hashes differ from the image's first block on."""
    name, d, model, proc, mark = family
    text = f"<|user|>the king and the queen of the world{mark} and what<|assistant|>"
    imgs = [make_image(11), make_image(12), make_image(11)]
    outs = {}
    for caching in (True, False):
        llm = LLM(d, kv_cache_memory=4 << 20, enable_prefix_caching=caching, block_size=4)
        outs[caching] = [list(llm.generate(engine_prompt(text, [im]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
                         for im in imgs]
        if caching:
            stats = llm.llm_engine.get_stats()
            assert stats.prefix_cache_hits > 0  # the text before the image, and all of the repeated image
        assert_pool_empty(llm)
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][2] != outs[True][1]
    assert outs[True][0] == hf_generate(model, proc, text, [imgs[0]], N)
    assert outs[True][1] == hf_generate(model, proc, text, [imgs[1]], N)


def test_encoder_cache_hit_is_counted(family):
    """The same image after other text (no prefix-cache hit on it) takes its embeddings from the
    encoder cache: counted, and the output is what a fresh encode gives."""
    name, d, model, proc, mark = family
    img = make_image(21)
    first = f"<|user|>{mark}the king<|assistant|>"
    second = f"<|user|>and now the queen{mark} again<|assistant|>"
    llm = LLM(d, kv_cache_memory=4 << 20)
    encoded = []
    tower = llm.llm_engine.executor.runner.vision
    real = tower.encode
    tower.encode = lambda items: (encoded.append(len(items)), real(items))[1]
    a = llm.generate(engine_prompt(first, [img]), GREEDY, use_tqdm=False)[0]
    b = llm.generate(engine_prompt(second, [img]), GREEDY, use_tqdm=False)[0]
    stats = llm.llm_engine.get_stats()
    assert (stats.mm_cache_queries, stats.mm_cache_hits) == (2, 1)
    assert encoded == [1]  # encoded once
    assert list(b.outputs[0].token_ids) == hf_generate(model, proc, second, [img], N)
    assert list(a.outputs[0].token_ids) == hf_generate(model, proc, first, [img], N)
    assert_pool_empty(llm)


def test_two_images_back_to_back(family):
    """Two placeholders with nothing between them (a chat message [image, image, text] under a
    template that writes one placeholder per part): after expansion LLaVA's image tokens form one
    run; it is split per image, as transformers' masked scatter does. Ids equal transformers'."""
    name, d, model, proc, mark = family
    a, b = make_image(31), make_image(32, (56, 40))
    text = f"<|user|>{mark}{mark}the king<|assistant|>"
    llm = LLM(d, kv_cache_memory=4 << 20)
    out = llm.generate(engine_prompt(text, [a, b]), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_generate(model, proc, text, [a, b], N)
    assert_pool_empty(llm)


def test_lora_adapter_with_images(family, tmp_path):
    """A PEFT LoRA adapter on the language model (q_proj/v_proj) with image prompts: ids equal
    transformers + peft's with the adapter, and the base model's without it, from one engine."""
    name, d, model, proc, mark = family
    if name != "llava":
        pytest.skip("one family is enough for the LoRA path")
    peft = pytest.importorskip("peft")
    import torch
    from pagedllm.lora.request import LoRARequest
    base = type(model).from_pretrained(d, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)",
                          lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(base, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.25)
    pm.save_pretrained(str(tmp_path))
    pm.eval()
    cases = [(f"<|user|>{mark}the king<|assistant|>", [make_image(41)]),
             (f"<|user|>{mark} and {mark}the king<|assistant|>", [make_image(41), make_image(42, (50, 30))])]
    want = [hf_generate(pm, proc, t, ims, N) for t, ims in cases]
    with pm.disable_adapter():
        want_base = [hf_generate(pm, proc, t, ims, N) for t, ims in cases]
    assert want != want_base
    llm = LLM(d, kv_cache_memory=4 << 20, enable_lora=True, max_lora_rank=8)
    prompts = [engine_prompt(t, ims) for t, ims in cases]
    lora = LoRARequest("ad", 1, str(tmp_path))
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, lora_request=lora,
                                                                use_tqdm=False)] == want
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want_base
    assert_pool_empty(llm)


def test_llava_with_a_siglip_tower(tmp_path):
    """LLaVA-Interleave's layout: a SigLIP tower (every patch, the last layer) and a Qwen2 language model."""
    model, proc = build_llava(str(tmp_path), seed=3, tower="siglip")
    cases = prompts("<image>")[:2]
    llm = LLM(str(tmp_path), kv_cache_memory=4 << 20)
    outs = llm.generate([engine_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected(model, proc, cases)
    assert_pool_empty(llm)


def test_pipeline_parallel_is_refused_for_an_image_model(family):
    """Pipeline parallelism's first stage embeds token ids only: an image-text model under it is refused
    at configuration, naming the architecture (not served with placeholder embeddings)."""
    with pytest.raises(ValueError, match=r"ForConditionalGeneration: image input with pipeline_parallel_size > 1"):
        EngineArgs(model=family[1], pipeline_parallel_size=2).create_engine_config()
    assert EngineArgs(model=family[1]).create_engine_config().model_config.is_multimodal


def test_chat_with_image_parts_equals_generate(family):
    name, d, model, proc, mark = family
    img = make_image(31)
    llm = LLM(d, kv_cache_memory=4 << 20)
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                         {"type": "text", "text": "the king and"}]}]
    chat = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    text = f"<|user|>{mark}the king and</s><|assistant|>"
    assert list(chat.outputs[0].token_ids) == hf_generate(model, proc, text, [img], N)
    assert_pool_empty(llm)


def test_speculative_decoding_beside_image_prefills(family):
    """n-gram proposals verified in the same steps as other requests' image prompt chunks: the same ids."""
    name, d, model, proc, mark = family
    cases = prompts(mark)
    text = ("the king and the queen and the king and the queen and the king and", [])  # proposals from the start
    cases = [text, text, *cases[:3]]  # text first: they decode (and propose) while the images prefill
    want = expected(model, proc, cases)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(d, kv_cache_memory=4 << 20, speculative_config=spec, max_num_batched_tokens=20)
    sp = llm.llm_engine.speculator
    real, mixed = sp.prepare_inputs, []

    def recording(*a):
        plan = real(*a)
        mixed.append(plan is not None and plan.model_input.mm is not None)
        return plan
    sp.prepare_inputs = recording
    outs = llm.generate([engine_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert any(mixed)  # a verification batch carried image tokens
    assert_pool_empty(llm)


def _local_vision_checkpoint() -> str:
    """A real image-text checkpoint on this machine: $PAGEDLLM_TEST_VISION_MODEL (a folder), or one of a
    few small Hub checkpoints already in the Hugging Face cache; "" when there is none."""
    import os

    path = os.environ.get("PAGEDLLM_TEST_VISION_MODEL", "")
    if path:
        return path if os.path.isdir(path) else ""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return ""
    for repo in ("llava-hf/llava-interleave-qwen-0.5b-hf", "google/gemma-3-4b-it", "llava-hf/llava-1.5-7b-hf"):
        try:
            return snapshot_download(repo, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the cache
            continue
    return ""


def test_real_checkpoint_when_installed():
    """A real checkpoint's tower loads and its answer depends on the image (greedy, 8 tokens)."""
    path = _local_vision_checkpoint()
    if not path:
        pytest.skip("no real image-text checkpoint here (set PAGEDLLM_TEST_VISION_MODEL to a LLaVA or Gemma 3 "
                    "folder, or have one in the Hugging Face cache)")
    llm = LLM(path, max_model_len=2048, dtype="float32")
    answers = []
    for seed in (1, 2):
        msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": make_image(seed, (224, 224))},
                                             {"type": "text", "text": "Describe the picture."}]}]
        answers.append(llm.chat(msgs, GREEDY, use_tqdm=False)[0].outputs[0].text)
    assert all(answers) and answers[0] != answers[1]
    assert_pool_empty(llm)


def test_preemption_recomputes_images(tmp_path_factory):
    """A KV cache too small for the batch: requests with images are preempted and recomputed (their
    images encoded again or taken from the encoder cache) and still give transformers' ids."""
    d = str(tmp_path_factory.mktemp("llava_preempt"))
    model, proc = build_llava(d, seed=5)
    cases = prompts("<image>")[:3] * 2
    n = 24
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm = LLM(d, kv_cache_memory=7 * 8192, max_model_len=64, block_size=16)
    outs = llm.generate([engine_prompt(t, i) for t, i in cases], sp, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    want = [hf_generate(model, proc, t, i, n) for t, i in cases[:3]] * 2
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert_pool_empty(llm)
