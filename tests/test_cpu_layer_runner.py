"""The CPU layer runner (platforms/cpu/layer_runner.py: all decoder layers in one C call a step)
against the Python layer loop it replaces: bit-identical logprobs in batches that mix decodes with
chunked prefills over block sizes 1-32 and prefix-cache hits, fp32 greedy tokens equal to
transformers (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms, Gemma 1, 2 and 3, Phi-3, Granite,
SmolLM3, OLMo 2, EXAONE 4), every block back
in the pool; and the models and steps it must leave to the loop; the layouts the layers declare
(platforms/layout.py), which the runner builds from without importing a model or layer class; the
block size taken from the step's metadata."""
from __future__ import annotations


import pytest
import torch

from conftest import assert_pool_empty, build_checkpoint, pagedllm_logs
from test_correctness import PROMPT_LENS, greedy, make_prompts, reference
from pagedllm import LLM
from pagedllm.platforms.cpu import layer_runner as cpu_layer_runner, float_gemm as float_gemm_cpu
from pagedllm.platforms.cpu import attention as cpu_kernel
from pagedllm.platforms.cpu.layer_runner import CpuLayerRunner

# Wide enough that every linear packs for float_gemm_cpu (>= 4 panels a thread, up to 4 threads).
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)


def _runner_or_skip() -> None:
    for lazy in (cpu_layer_runner._LIBRARY, float_gemm_cpu._LIBRARY, cpu_kernel._LIBRARY):
        lib, err = lazy.get()
        if lib is None:
            pytest.skip(f"a CPU kernel library cannot be built here: {err}")
    if float_gemm_cpu._GEMM.get(torch.float32) is None:
        pytest.skip("no float32 packed GEMM on this CPU (needs AVX-512 or AVX2 with FMA)")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite", "smollm3",
                                                "olmo2", "exaone4", "phi3", "phi3_partial", "olmo3", "glm"])
def wide_dir(request, tmp_path_factory):
    """Llama, Qwen2 (biases on q/k/v: the GEMM's bias pointer), Qwen3 (RMSNorms on q and k per head,
    before RoPE), Gemma 2 (sliding windows on alternate layers, soft-capped scores, four norms a layer,
    GELU-tanh), Gemma 3 (q/k norms, a RoPE table per layer type), Phi-3 (LongRoPE's scaled table,
    a 48-token window on every layer through its SlidingWindowBackend), Phi-3 with 3/4 of each
    head's channels rotating (Phi-4-mini's partial rotary), Gemma 1 (two norms, plain residual adds),
    Granite (residual multiplier, attention multiplier as the scale), SmolLM3 (NoPE layers), OLMo 2
    (norms after each branch, q/k norms over all heads) and EXAONE 4 (OLMo 2's layer, per-head q/k
    norms, sliding layers around a global NoPE one), OLMo 3 (OLMo 2's layer, sliding layers, a RoPE
    table per layer type) and GLM-4 (interleaved RoPE on half of each head's channels, loaded as
    Llama's; ERNIE 4.5 and Cohere load theirs the same way)."""
    extra = dict(head_dim=64) if request.param in ("qwen3", "gemma", "gemma2", "gemma3", "glm") else {}
    # Built once a session: the tests that run on a subset of the families (_subset) set this fixture up
    # again between other families, and test_correctness.reference caches transformers' ids by the path.
    d = tmp_path_factory.getbasetemp() / f"wide_{request.param}"
    if not (d / "generation_config.json").exists():  # (written last)
        build_checkpoint(str(d), request.param, **WIDE, **extra)
    return str(d)


def _model(llm):
    return llm.llm_engine.executor.runner.model


def _run(llm, prompts, on: bool, **kw):
    model = _model(llm)
    model.use_cpu_layer_runner = on
    runner = model.__dict__.get("_cpu_layer_runner")
    before = runner.steps_run if runner else 0
    outs = llm.generate(prompts, greedy(logprobs=2, **kw), use_tqdm=False)
    runner = model.__dict__.get("_cpu_layer_runner")
    ran = (runner.steps_run if runner else 0) - before
    assert (ran > 0) == on, f"runner {'on' if on else 'off'} but it ran {ran} steps"
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


# Each family's own ops (biases, q/k norms, windows, RoPE tables, multipliers, post-norms) run against the
# loop in fp32 at block size 16 (test_runner_equals_layer_loop_bit_for_bit). The paths that do not depend on
# the family's ops (block sizes, bf16, the int8 KV cache and weights, phase timings, cached prefixes) run on
# a few families that cover each layer kind the runner builds (Llama's, Gemma's, post-norm: PHASES,
# GEMMA_PHASES, POST_NORM_PHASES) and each window layout (Gemma 2: alternate layers; Phi-3: every layer
# through its SlidingWindowBackend; EXAONE 4 / OLMo 3: sliding around global layers).
def _subset(*families):
    return pytest.mark.parametrize("wide_dir", families, indirect=True)


def test_runner_equals_layer_loop_bit_for_bit(wide_dir):
    _check_runner_equals_layer_loop(wide_dir, 16)


@_subset("llama", "gemma2", "phi3", "exaone4")
@pytest.mark.parametrize("block_size", [1, 32])
def test_runner_equals_layer_loop_other_block_sizes(wide_dir, block_size):
    _check_runner_equals_layer_loop(wide_dir, block_size)


def _check_runner_equals_layer_loop(wide_dir, block_size):
    _runner_or_skip()
    # Phi-3's long factors equal transformers' only for prompts longer than its original length (4)
    prompts = make_prompts(500, lens=[n for n in PROMPT_LENS if n > 4] if "phi3" in wide_dir else PROMPT_LENS)
    # 64-token steps: prompts split into chunks that share steps with other requests' decodes
    llm = LLM(wide_dir, dtype="float32", kv_cache_memory=16 << 20, block_size=block_size, max_num_batched_tokens=64,
              max_num_seqs=8, enable_prefix_caching=False)
    loop = _run(llm, prompts, False)
    runner = _run(llm, prompts, True)
    assert runner == loop  # tokens and logprobs, exactly
    if wide_dir.endswith("_llama"):  # Llama's steps from their token ids (embedding, RoPE, final norm in C too),
        stack = _model(llm).__dict__["_cpu_layer_runner"]  # plain decode steps with the LM head too
        assert stack.token_steps_run > 0 and stack.logit_steps_run > 0
    assert [t for t, _ in runner] == [t for t, _ in reference(wide_dir, prompts)]  # transformers' greedy
    assert_pool_empty(llm)


@_subset("qwen2", "gemma3", "exaone4")
def test_runner_in_bfloat16(wide_dir):
    """bfloat16 weights, activations and KV cache, on float_gemm_cpu's bf16 GEMM (AVX512-BF16's
    products, or AVX2's bf16 widened to float32 as it loads): the runner equals the loop bit for bit."""
    _runner_or_skip()
    if float_gemm_cpu._GEMM.get(torch.bfloat16) is None:
        pytest.skip("no bf16 packed GEMM on this CPU (needs AVX512-BF16, or AVX2 + FMA without AVX-512)")
    prompts = make_prompts(300, lens=[n for n in PROMPT_LENS if n > 4] if "phi3" in wide_dir else PROMPT_LENS)
    llm = LLM(wide_dir, dtype="bfloat16", kv_cache_memory=16 << 20, max_num_batched_tokens=64, max_num_seqs=8,
              enable_prefix_caching=False)
    qkv = _model(llm).layers[0].self_attn.qkv_proj
    assert qkv.gemm_weight.dtype == torch.bfloat16  # packed for the bf16 GEMM, not left to oneDNN
    loop = _run(llm, prompts, False)
    runner = _run(llm, prompts, True)
    assert runner == loop
    assert_pool_empty(llm)


@_subset("llama", "gemma2", "olmo3")
def test_runner_with_int8_kv_cache(wide_dir):
    """An int8 KV cache: the runner quantizes with the kernels' int8 write and reads with their
    int8-cache attention, as the loop does."""
    _runner_or_skip()
    prompts = make_prompts(500)
    llm = LLM(wide_dir, dtype="float32", kv_cache_memory=16 << 20, kv_cache_dtype="int8", max_num_batched_tokens=64,
              max_num_seqs=8, enable_prefix_caching=False)
    loop = _run(llm, prompts, False)
    runner = _run(llm, prompts, True)
    assert runner == loop
    assert_pool_empty(llm)


@_subset("qwen2", "gemma", "olmo2")
def test_runner_with_int8_weights(wide_dir):
    """``--quantization int8``: the runner calls the int8 method's one-call W8A8 linear on the
    packed panels (int8_gemm_cpu.panel_linear), as the loop does; the SmoothQuant calibration pass
    before quantizing does not leave the runner judged on the float model."""
    from pagedllm.layers.quantization.int8 import Int8LinearMethod

    _runner_or_skip()
    prompts = make_prompts(300)
    llm = LLM(wide_dir, dtype="float32", kv_cache_memory=16 << 20, quantization="int8", max_num_batched_tokens=64,
              max_num_seqs=8, enable_prefix_caching=False)
    qkv = _model(llm).layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method) is Int8LinearMethod
    if getattr(qkv, "weight_packed", None) is None:
        pytest.skip("no int8 panel GEMM here (needs AVX512-VNNI or AVX2)")
    loop = _run(llm, prompts, False)
    runner = _run(llm, prompts, True)
    assert runner == loop
    # A VNNI CPU's layers leave their panels above 128 rows (panel_max_rows), and so does the
    # runner: at 32, the 64-token steps run the loop (oneDNN's int8 GEMM), the decodes the runner.
    model = _model(llm)
    for layer in model.layers:
        for lin in cpu_layer_runner._linears(layer):
            lin.panel_max_rows = 32
    del model.__dict__["_cpu_layer_runner"]
    mixed = _run(llm, prompts, True)
    assert model.__dict__["_cpu_layer_runner"].max_rows == 32
    assert mixed == loop
    assert_pool_empty(llm)


@_subset("granite", "gemma3", "olmo3")
def test_runner_phase_timings(wide_dir):
    """The runner's optional timings (bench profile's breakdown): every phase of every layer gets
    time, together no more than the steps' wall time, and timing changes no output."""
    import time

    _runner_or_skip()
    prompts = make_prompts(200)
    llm = LLM(wide_dir, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=64, max_num_seqs=8,
              enable_prefix_caching=False)
    plain = _run(llm, prompts, True)
    runner = _model(llm).__dict__["_cpu_layer_runner"]
    assert runner.phase_seconds() == {}  # off unless asked
    runner.timing_on()
    t0 = time.perf_counter()
    timed = _run(llm, prompts, True)
    wall = time.perf_counter() - t0
    assert timed == plain
    phases = runner.phase_seconds()
    kind = ("post_norm" if any(f in wide_dir for f in ("olmo2", "olmo3", "exaone4")) else
            "gemma" if "gemma" in wide_dir else "llama")
    names = {"llama": cpu_layer_runner.PHASES, "gemma": cpu_layer_runner.GEMMA_PHASES,
             "post_norm": cpu_layer_runner.POST_NORM_PHASES[1:]}[kind]
    assert list(phases) == list(names)
    assert all(v > 0 for v in phases.values()), phases
    assert sum(phases.values()) < wall
    assert_pool_empty(llm)


@_subset("llama", "gemma2", "phi3")
def test_runner_over_cached_prefixes(wide_dir):
    """Second pass: every prompt's full blocks come from the prefix cache, so each prefill chunk
    attends over a cached prefix; the first pass (cold) runs the loop, the second the runner."""
    _runner_or_skip()
    prompts = make_prompts(500, lens=[40, 96, 150, 231])
    llm = LLM(wide_dir, dtype="float32", kv_cache_memory=16 << 20, block_size=16, enable_prefix_caching=True)
    cold = _run(llm, prompts, False)
    warm = _run(llm, prompts, True)
    assert warm == cold
    assert_pool_empty(llm)


def test_runner_left_to_the_loop(tmp_path):
    """What it does not cover runs the Python loop, with the reason logged once: a sparse MoE MLP
    (Mixtral), a Gemma MLP with exact GELU, a model too narrow to pack its linears (hidden 64), and
    a step without KV caches or in another dtype."""
    from test_models_moe import build_moe_checkpoint

    _runner_or_skip()
    erf_gemma = build_checkpoint(str(tmp_path / "gemma_erf"), "gemma2", **WIDE, hidden_activation="gelu")
    for path, why in ((build_moe_checkpoint(str(tmp_path / "moe"), "mixtral"),
                       "MLP SparseMoeBlock, not the dense SwiGLU one"),
                      (erf_gemma, "a Gemma MLP whose activation is not GELU-tanh")):
        # pagedllm_logs, not caplog: pytest 9.2's caplog also attaches to non-propagating loggers,
        # so a test that made pagedllm's logger propagate saw each record twice there.
        with pagedllm_logs() as records:
            llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20)
            out = llm.generate([[5, 6, 7]], greedy(n=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert _model(llm).__dict__.get("_cpu_layer_runner") is False
        messages = [r.getMessage() for r in records]
        assert [m for m in messages if m.startswith("cpu layer runner")] == [f"cpu layer runner: off ({why})"]

    llm = LLM(build_checkpoint(str(tmp_path / "narrow")), dtype="float32", kv_cache_memory=4 << 20)
    assert llm.generate([[5, 6, 7]], greedy(n=2), use_tqdm=False)[0].outputs[0].token_ids
    runner, why = CpuLayerRunner.build(_model(llm))
    o_proj = _model(llm).layers[0].self_attn.o_proj  # 64 columns: too few panels to pack on 2+ threads
    assert getattr(o_proj, "gemm_weight", None) is None
    assert runner is None and why.startswith("a RowParallelLinear of 64 output columns is too narrow to pack for "
                                             "float_gemm_cpu on ")

    llm = LLM(build_checkpoint(str(tmp_path / "wide"), **WIDE), dtype="float32", kv_cache_memory=4 << 20)
    llm.generate([[5, 6, 7]], greedy(n=2), use_tqdm=False)
    runner = _model(llm).__dict__["_cpu_layer_runner"]
    assert isinstance(runner, CpuLayerRunner)
    x = torch.randn(3, WIDE["hidden_size"])

    class NoCache:  # the KV-cache-less profiling pass
        block_tables = None

    assert runner.run(x, None, None, [None] * WIDE["num_hidden_layers"], NoCache()) is None
    assert runner.run(x.to(torch.bfloat16), None, None, [], NoCache()) is None


def test_ministral3_runner_within_its_original_length(tmp_path):
    """Ministral 3's query scaling is 1 below original_max_position_embeddings (64 here): with
    max_model_len 64 the runner takes the layers, bit-equal to the loop; with 512 the scaling is
    on and the loop runs it, equal to transformers past position 64 (logged why)."""
    _runner_or_skip()
    d = build_checkpoint(str(tmp_path / "ministral3"), "ministral3", **WIDE, head_dim=64, max_position_embeddings=512)
    short = make_prompts(500, lens=[3, 20, 40])
    llm = LLM(d, dtype="float32", kv_cache_memory=16 << 20, max_model_len=64, max_num_batched_tokens=32)
    assert _run(llm, short, True) == _run(llm, short, False)
    longer = make_prompts(500, lens=[70, 150])
    with pagedllm_logs() as records:
        llm = LLM(d, dtype="float32", kv_cache_memory=16 << 20, max_model_len=512)
        outs = llm.generate(longer, greedy(), use_tqdm=False)
    assert _model(llm).__dict__.get("_cpu_layer_runner") is False
    assert "cpu layer runner: off (Llama 4's query scaling (Ministral 3 with max_model_len past " \
           "original_max_position_embeddings))" in [r.getMessage() for r in records]
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _ in reference(d, longer)]
    assert_pool_empty(llm)


def test_hunyuan_q_k_norms_after_rope_run_the_loop(tmp_path):
    """The runner norms q and k before RoPE; HunYuan's norms follow it, so the loop runs HunYuan
    (logged why), equal to transformers."""
    _runner_or_skip()
    d = build_checkpoint(str(tmp_path / "hunyuan"), "hunyuan", **WIDE, head_dim=64)
    prompts = make_prompts(500, lens=[5, 40])
    with pagedllm_logs() as records:
        llm = LLM(d, dtype="float32", kv_cache_memory=16 << 20)
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert "cpu layer runner: off (q/k norms after RoPE (HunYuan))" in [r.getMessage() for r in records]
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _ in reference(d, prompts)]


def test_layers_declare_their_layouts():
    """Each family's decoder layer declares what it is made of (platforms/layout.py), and a subclass
    that overrides a forward is not described by the layout it inherits."""
    import transformers

    from pagedllm.layers.attention import TorchPagedAttention
    from pagedllm.layers.rotary_embedding import RotaryEmbedding
    from pagedllm.models.gemma import GemmaDecoderLayer
    from pagedllm.models.gemma2 import Gemma2DecoderLayer
    from pagedllm.models.glm4 import Glm4DecoderLayer
    from pagedllm.models.llama import LlamaDecoderLayer
    from pagedllm.models.olmo2 import Olmo2DecoderLayer
    from pagedllm.platforms.layout import DecoderLayout, norm_paths

    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=1)
    backend = TorchPagedAttention()
    layout, why = LlamaDecoderLayer(llama, torch.float32, backend, False, True).decoder_layout()
    assert why == "" and layout == DecoderLayout("llama", norm_paths({
        "in": "input_layernorm", "post": "post_attention_layernorm", "q": "self_attn.q_norm", "k": "self_attn.k_norm"}))
    assert (layout.norm, layout.qk_norm, layout.mlp) == ("rms", "head", "swiglu")

    class Overridden(LlamaDecoderLayer):  # the same modules, another forward: not Llama's layout
        def forward_fused(self, *args, **kwargs):
            return super().forward_fused(*args, **kwargs)

    assert Overridden(llama, torch.float32, backend, False, False).decoder_layout() == (
        None, "Overridden is not the plain llama decoder layer")
    glm = transformers.Glm4Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_hidden_layers=1)
    assert Glm4DecoderLayer(glm, torch.float32, backend, False, False).decoder_layout() == (
        None, "Glm4DecoderLayer is not the plain llama decoder layer")
    # OLMo 2: q/k norms over all heads; EXAONE 4 (the same layer over LlamaAttention): per head
    whole, _ = Olmo2DecoderLayer(llama, torch.float32, backend, False, False).decoder_layout()
    per_head, _ = Olmo2DecoderLayer(llama, torch.float32, backend, False, True).decoder_layout()
    assert (whole.kind, whole.qk_norm, per_head.qk_norm) == ("post_norm", "whole", "head")
    assert dict(whole.norms) == {"in": None, "post": "post_attention_layernorm", "q": "self_attn.q_norm",
                                 "k": "self_attn.k_norm", "pre_ff": None, "post_ff": "post_feedforward_layernorm"}

    rot = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=1)
    gemma2, _ = Gemma2DecoderLayer(transformers.Gemma2Config(**kw), "full_attention", rot, torch.float32,
                                   backend).decoder_layout()
    assert (gemma2.kind, gemma2.norm, gemma2.mlp) == ("gemma", "gemma_rms", "gelu_tanh")
    assert all(path is not None for slot, path in gemma2.norms)
    exact, _ = Gemma2DecoderLayer(transformers.Gemma2Config(**kw, hidden_activation="gelu"), "full_attention", rot,
                                  torch.float32, backend).decoder_layout()
    assert exact.mlp == "gated"  # the runner leaves exact GELU to the loop
    gemma1, _ = GemmaDecoderLayer(transformers.GemmaConfig(**kw), "full_attention", rot, torch.float32,
                                  backend).decoder_layout()  # its own forward: its own layout, not Gemma 2's
    assert dict(gemma1.norms) == {"in": "input_layernorm", "post": None, "q": "self_attn.q_norm",
                                  "k": "self_attn.k_norm", "pre_ff": "post_attention_layernorm", "post_ff": None}
    with pytest.raises(ValueError, match="not a decoder layout"):
        DecoderLayout("mamba", norm_paths({}))


def test_runner_imports_no_model_or_layer():
    """The runner builds from the declared layout and the modules' attributes: no import of
    pagedllm.models or pagedllm.layers (at module level or inside a function), and no model calls it."""
    import ast
    from pathlib import Path

    import pagedllm.models

    def imports(path: Path) -> list[str]:  # every module and name an import statement names
        return [f"{n.module}.{a.name}" if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names]

    names = imports(Path(cpu_layer_runner.__file__))
    assert "pagedllm.platforms.layout.DecoderLayout" in names
    assert not [m for m in names if m.startswith(("pagedllm.models", "pagedllm.layers"))], names
    for f in Path(pagedllm.models.__file__).parent.glob("*.py"):
        assert not [m for m in imports(f) if "layer_runner" in m], f


def test_block_size_comes_from_the_step(tmp_path):
    """The runner takes the block size from the step's metadata (meta.block_size), and refuses a
    step whose block size is not the one the caches' blocks hold (their rows: block_size, and an
    int8 cache's scale rows after them)."""
    from pagedllm.layers.attention import AttentionMetadata

    _runner_or_skip()
    for cache_dtype in ("auto", "int8"):
        llm = LLM(build_checkpoint(str(tmp_path / f"wide_{cache_dtype}"), **WIDE), dtype="float32",
                  kv_cache_memory=4 << 20, block_size=16, kv_cache_dtype=cache_dtype)
        llm.generate([[5, 6, 7]], greedy(n=2), use_tqdm=False)
        model, caches = _model(llm), llm.llm_engine.executor.runner.kv_caches
        runner = model.__dict__["_cpu_layer_runner"]
        positions = torch.arange(3)

        def step(block_size: int):
            meta = AttentionMetadata.build(torch.tensor([16, 17, 18]), [[1]], [3], [3], block_size, "cpu")
            x = torch.randn(3, WIDE["hidden_size"])
            return runner.run(x, None, model.rope_tables(positions), caches, meta)

        assert step(16) is not None and runner.dims.block_size == 16
        assert step(8) is None and step(32) is None  # not these caches' blocks: the loop's (which raises)
        assert step(16) is not None
        assert_pool_empty(llm)
