"""Shared fixtures: tiny random-weight checkpoints (Llama, Qwen2, Qwen3) with a byte-level BPE
tokenizer, built in a temp dir with transformers and tokenizers. Nothing is downloaded."""
from __future__ import annotations

import contextlib
import logging
import os
import random

# Triton's interpreter runs the CUDA wing's Triton kernels on the CPU (tests/test_triton_*.py). Triton
# reads TRITON_INTERPRET when triton.language is imported, and transformers imports triton through torch
# long before those test modules load: so it is set here, before anything imports torch, on a host with
# no NVIDIA GPU (where the kernels compile for real instead).
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The oracle is transformers in float32: keep --dtype auto at float32 even on CPUs with native bf16
# (tests of the auto rule itself clear this).
os.environ.setdefault("PAGEDLLM_CPU_AUTO_DTYPE", "float32")
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(2)

_WORDS = ("the of and to in is was he for it with as his on be at by had are but from or have an they which one "
          "you were her all she there would their we him been has when who will more no if out so said what up its "
          "about into than them can only other new some could time these two may then do first any my now such like "
          "our over man me even most made after also did many before must through back years where much your way "
          "well down should because each just those people how too little state good very make world still own see "
          "men work long get here between both life being under never day same another know while last might us great "
          "old year off come since against go came right used take three king queen lord romeo juliet thou thee thy").split()

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def corpus(n_words: int = 20000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 10):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 17))) + rng.choice([".", ",", "!", "?"]))
    return "\n".join(lines) + " caf\u00e9 na\u00efve \u65e5\u672c \U0001f600"


@contextlib.contextmanager
def pagedllm_logs():
    """The log records (INFO and up) the ``pagedllm`` logger emits inside the block, as a list (the
    logger may not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("pagedllm")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def build_tokenizer(out_dir: str, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>", "<|user|>",
                                                                         "<|assistant|>", "<|system|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus().split("\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A tiny random-weight model of ``arch`` (llama | qwen2 | qwen3 | mistral | gemma | gemma2 | gemma3 |
    granite | smollm3 | olmo2 | olmo3 | exaone4 | ministral3 | glm | hunyuan | phi3 | phi3_partial: Phi-3 with 3/4 of
    each head's channels rotating, as Phi-4-mini) saved with save_pretrained."""
    import transformers

    tok = build_tokenizer(out_dir)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=0.15, tie_word_embeddings=False)
    common.update(overrides)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "phi3_partial": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM),
        "glm": (transformers.GlmConfig, transformers.GlmForCausalLM),
        "hunyuan": (transformers.HunYuanDenseV1Config, transformers.HunYuanDenseV1ForCausalLM),
    }[arch]
    if arch == "hunyuan":
        common.setdefault("head_dim", 16)
    if arch == "glm":  # interleaved RoPE on half of each head's channels; q/k/v biases
        common.setdefault("head_dim", 16)
    if arch == "olmo3":  # sliding layers (24-token window) around global ones, a RoPE per layer type
        common.setdefault("sliding_window", 24)
        n = common["num_hidden_layers"]
        common.setdefault("layer_types", ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(n)])
        common.setdefault("rope_parameters", {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}})
    if arch == "ministral3":  # YaRN past 64 positions; Llama 4's query scaling past them too
        common.setdefault("head_dim", 16)
        common.setdefault("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                              "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.3})
    if arch == "exaone4":  # hybrid: sliding layers (24-token window, RoPE) around a global NoPE one
        common.setdefault("sliding_window", 24)
        common.setdefault("sliding_window_pattern", 2)
    if arch == "gemma":
        common.setdefault("head_dim", 16)
    if arch == "granite":  # each of Granite's four scalars away from 1 (and the scale from head_dim ** -0.5)
        common.update(embedding_multiplier=2.5, attention_multiplier=0.2, residual_multiplier=0.7,
                      logits_scaling=1.7)
    if arch == "smollm3":  # NoPE on every other layer (SmolLM3 3B: every 4th)
        common.setdefault("no_rope_layers", [int(i % 2 == 0) for i in range(common["num_hidden_layers"])])
    if arch == "phi3_partial":
        common.setdefault("partial_rotary_factor", 0.75)
    if arch.startswith("phi3"):  # LongRoPE past 4 positions (long factors; prompts longer than that), a 48-token window
        head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
        half = int(head_dim * common.get("partial_rotary_factor", 1.0)) // 2
        rng = torch.Generator().manual_seed(seed)
        common.setdefault("original_max_position_embeddings", 4)
        common.setdefault("sliding_window", 48)
        common.setdefault("rope_scaling", {"rope_type": "longrope",
                                           "short_factor": (1 + 2 * torch.rand(half, generator=rng)).tolist(),
                                           "long_factor": (2 + 6 * torch.rand(half, generator=rng)).tolist()})
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    if arch in ("gemma2", "gemma3"):  # windows shorter than most prompts; Gemma 2: soft-capped scores
        common.setdefault("head_dim", 16)
        common.setdefault("sliding_window", 24)
        common.setdefault("query_pre_attn_scalar", 24)
        if arch == "gemma2":
            common.setdefault("attn_logit_softcapping", 2.0)
            common.setdefault("final_logit_softcapping", 3.0)
        else:  # a global layer between local ones, each type its own RoPE base
            n = common["num_hidden_layers"]
            common.setdefault("layer_types", ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(n)])
            common.setdefault("rope_parameters", {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
    config = cls_cfg(**common)
    torch.manual_seed(seed)
    model = cls_model(config).eval()
    with torch.no_grad():  # transformers zero-initializes biases (Qwen2's q/k/v): random ones show up
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            if arch == "hunyuan" and "layernorm" in name:  # weights of 1 would commute with RoPE
                p.normal_(1.0, 0.5)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=2)


def assert_pool_empty(llm) -> None:
    """Every block is back in the pool and no request is left inside the engine."""
    engine = llm.llm_engine if hasattr(llm, "llm_engine") else llm
    pool = engine.kv_cache_manager.block_pool
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks if b is not pool.null_block)
    assert pool.null_block is None or pool.null_block.ref_cnt == 1
    assert pool.num_cached_free_blocks == sum(b.block_hash is not None for b in pool.blocks)


def record_schedule(llm, monkeypatch) -> list[tuple[str, int, int, int]]:
    """Record every (request id, computed tokens before, new tokens, prompt tokens) the scheduler
    sends to the model, in order, for the rest of the test."""
    sched = llm.llm_engine.scheduler
    log: list[tuple[str, int, int, int]] = []
    real = sched.schedule

    def recording():
        out = real()
        log.extend((r.request_id, r.num_computed_tokens, n, r.num_prompt_tokens) for r, n in out.scheduled)
        return out

    monkeypatch.setattr(sched, "schedule", recording)
    return log


# ---- one `pagedllm serve` of the tiny Llama for the modules that need no flag of their own ----------
# A server start is 10-20 s of the suite; test_server, test_server_instructor and test_server_vllm_dropin's
# flags-off checks used three servers with these same settings (the tokenizer's own chat template).
TINY_SERVER_ARGS = ("--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "4MiB",
                    "--max-num-seqs", "64", "--disable-access-log", "--max-request-bytes", "1MiB")


@pytest.fixture(scope="session")
def tiny_server(llama_dir, tmp_path_factory):
    """A RemoteServer of ``llama_dir`` with TINY_SERVER_ARGS, for the whole session; it must exit 0."""
    from server_utils import RemoteServer

    log = str(tmp_path_factory.mktemp("tiny_server") / "server.log")
    with RemoteServer(llama_dir, TINY_SERVER_ARGS, log_path=log) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


# ---- clients of a test module's ``server`` fixture (a RemoteServer) -------------------------------
# With an API key, a module names it ``KEY``; both clients then send it.
@pytest.fixture(scope="module")
def client(server, request):
    """The official openai client of the module's server."""
    import openai

    key = getattr(request.module, "KEY", None) or "unused"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server, request):
    """An httpx client of the module's server (for raw requests and error paths)."""
    import httpx

    key = getattr(request.module, "KEY", None)
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {key}"} if key else {}) as c:
        yield c


def greedy_up_to_near_ties(hf, prompts, ids, near_tie: float = 0.1) -> int:
    """Teacher-forced on our greedy ``ids``: each token is transformers' best or within ``near_tie``
    of it, and the best wherever the top-2 gap exceeds ``near_tie`` (0.1 by default: on the tiny random
    models, whose logits have a std of about 1.2, int8 activations (the GGUF kernels) moved near-ties of
    0.01-0.03; a wrong kernel picks tokens a std or more below). Returns the number of such clear
    steps (a caller asserts there are enough for the check to have teeth)."""
    clear_steps = 0
    for p, got in zip(prompts, ids):
        got = list(got)
        with torch.no_grad():
            logits = hf(torch.tensor([p + got])).logits[0, len(p) - 1:-1]
        top2 = logits.topk(2, dim=-1).values
        ours = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert torch.all(top2[:, 0] - ours <= near_tie), (top2[:, 0] - ours).tolist()
        clear = top2[:, 0] - top2[:, 1] > near_tie
        assert torch.equal(ours[clear], top2[clear, 0])
        clear_steps += int(clear.sum())
    return clear_steps
