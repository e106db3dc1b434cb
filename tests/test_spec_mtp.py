"""Speculative decoding's mtp method (spec_decode/mtp.py, models/mtp.py) on tiny random DeepSeek-V3,
GLM-4.5 and MiMo (Qwen2) checkpoints with one multi-token-prediction layer written into their safetensors
(transformers neither builds nor saves it): the layer's logits equal the formula computed with transformers' own
decoder-layer class on the same weights; greedy output with mtp equals decoding without speculation and
transformers' generate (through chunked prefill, n = 2, preemption and prefix caching); seeded samples
keep the target's distribution (chi-square); pools empty after every run; clear errors where the
checkpoint has no MTP layer."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import assert_pool_empty, build_checkpoint, pagedllm_logs
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.kv_cache_manager import cdiv
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.spec_decode.config import parse_speculative_config
from test_correctness import hf_greedy, make_prompts
from test_models_deepseek import build_checkpoint as build_deepseek
from test_models_moe import build_moe_checkpoint
from test_spec_decode import assert_sampled_distribution_unchanged, engine, token_ids

MTP = {"method": "mtp", "num_speculative_tokens": 3}
LAYER_CLS = {"v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
             "glm4_moe": transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer,
             "mimo": transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer}
ARCHS = list(LAYER_CLS)
# the layer's own tensors by layout: (token norm, hidden norm, projection, final norm, head, block prefix)
NAMES = {"deepseek": ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", ""),
         "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", None, "mtp_block.")}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) -> the checkpoints' ``experts.N.{gate,up,down}_proj.weight`` (what save_pretrained writes)."""
    out = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            base, half = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``per_expert``."""
    out, experts = {}, {}
    for name, t in sd.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[:i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = t
        else:
            out[name] = t
    for base, ts in experts.items():
        n = max(e for e, _ in ts) + 1
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([ts[(e, "gate_proj")], ts[(e, "up_proj")]])
                                                   for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([ts[(e, "down_proj")] for e in range(n)])
    return out


def layout(arch: str) -> tuple[str, tuple]:
    """(checkpoint prefix of the MTP layer's tensors, NAMES entry) for an architecture of 3 layers."""
    return ("model.mtp_layers.0.", NAMES["mimo"]) if arch == "mimo" else ("model.layers.3.", NAMES["deepseek"])


def hf_config(model_dir: str):
    """transformers' config of a test checkpoint (MiMo's "mimo" type is remote code: Qwen2's reads it)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    if raw.get("model_type") == "mimo":
        return transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    return transformers.AutoConfig.from_pretrained(model_dir)


def add_mtp_layer(model_dir: str, arch: str, seed: int, echo: bool = False) -> dict[str, torch.Tensor]:
    """Write one MTP layer (DeepSeek's layout at model.layers.{num_hidden_layers}.*, MiMo's at
    model.mtp_layers.0.*) into ``model_dir``'s safetensors and set num_nextn_predict_layers=1 (MiMo: its
    architecture and model_type too); returns its tensors. Random, or with ``echo`` one that proposes the
    target's own last prediction again (block outputs zeroed, the projection passing the normed hidden
    state, the LM head): right wherever the output repeats a token."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    n, hsz = config.num_hidden_layers, config.hidden_size
    prefix, (tnorm, hnorm, proj, fnorm, head, block) = layout(arch)
    torch.manual_seed(seed)
    layer = LAYER_CLS[arch](config, layer_idx=n if arch != "mimo" else 0)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    mtp = {}
    with torch.no_grad():
        for name, p in [*layer.named_parameters(), *layer.named_buffers()]:
            if name.endswith("layernorm.weight"):
                p.copy_(torch.randn(p.shape) * 0.3 + 1)
            elif name.endswith("e_score_correction_bias") or name.endswith("_proj.bias"):
                p.copy_(torch.randn(p.shape) * 0.3)
            elif name.endswith("mlp.gate.weight") or p.dim() >= 2:
                p.copy_(torch.randn(p.shape) * (0.5 if name.endswith("mlp.gate.weight") else 0.15))
            if echo and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
            mtp[block + name] = p.detach().clone().contiguous()
    for norm in (tnorm, hnorm, fnorm):
        mtp[f"{norm}.weight"] = torch.ones(hsz) if echo else torch.randn(hsz) * 0.3 + 1
    eye = [torch.eye(hsz), torch.zeros(hsz, hsz)] if arch == "mimo" else [torch.zeros(hsz, hsz), torch.eye(hsz)]
    mtp[f"{proj}.weight"] = torch.cat(eye, 1) if echo else torch.randn(hsz, 2 * hsz) * 0.15
    if head:
        mtp[f"{head}.weight"] = (tensors["lm_head.weight"].clone() if echo
                                 else torch.randn(config.vocab_size, hsz) * 0.15)
        mtp["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()  # (DeepSeek-V3 ships a copy)
    tensors.update({prefix + k: v for k, v in per_expert(mtp).items()})
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    raw["num_nextn_predict_layers"] = 1
    if arch == "mimo":
        raw.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    return mtp


def build(out_dir: str, arch: str, seed: int = 0, echo: bool = False) -> str:
    if arch == "v3":
        build_deepseek(out_dir, "v3", seed=seed)
    elif arch == "mimo":
        build_checkpoint(out_dir, "qwen2", seed=seed, num_hidden_layers=3)
    else:
        build_moe_checkpoint(out_dir, arch, seed=seed)
    add_mtp_layer(out_dir, arch, seed + 100, echo=echo)
    return out_dir


@pytest.fixture(scope="module", params=ARCHS)
def mtp_dir(request, tmp_path_factory):
    return build(str(tmp_path_factory.mktemp(f"mtp_{request.param}")), request.param, seed=3)


@pytest.fixture(scope="module", params=ARCHS)
def echo_dir(request, tmp_path_factory):
    return build(str(tmp_path_factory.mktemp(f"echo_{request.param}")), request.param, seed=5, echo=True)


def mtp_state_empty(llm: LLM) -> None:
    mtp = llm.llm_engine.speculator.mtp
    assert not mtp.pending and not mtp.last_probs


# ---- settings ----------------------------------------------------------------------------------------------
def test_config_names_and_defaults(mtp_dir):
    for alias in ("mtp", "deepseek_mtp", "glm4_moe_mtp", "mimo_mtp"):
        assert parse_speculative_config({"method": alias, "num_speculative_tokens": 2}).method == "mtp"
    # k defaults to the checkpoint's num_nextn_predict_layers, as vLLM's; the target may be named
    cfg = EngineArgs(model=mtp_dir, speculative_config={"method": "mtp", "model": mtp_dir}).create_engine_config()
    assert cfg.speculative_config.num_speculative_tokens == 1
    with pytest.raises(ValueError, match="runs the target's own layers"):
        EngineArgs(model=mtp_dir, speculative_config={"method": "mtp", "model": os.path.dirname(mtp_dir)}
                   ).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineArgs(model=mtp_dir, tensor_parallel_size=2, speculative_config=MTP).create_engine_config()


def test_checkpoints_without_mtp_layers_are_refused(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1 in its config"):
        EngineArgs(model=llama_dir, speculative_config=MTP).create_engine_config()
    # DeepSeek-V3's config says one layer (transformers' default) but the file has none: named at load
    bare = build_deepseek(str(tmp_path / "bare"), "v3", seed=1)
    with pytest.raises(ValueError, match=r"lacks its multi-token-prediction layer \(model\.layers\.3\.\*\).*missing"):
        engine(bare, MTP)
    with open(os.path.join(bare, "config.json")) as f:
        raw = json.load(f)
    raw["num_nextn_predict_layers"] = 0
    with open(os.path.join(bare, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM has none"):
        engine(bare, MTP)


# ---- the layer ------------------------------------------------------------------------------------------------
def arch_of(model_dir: str) -> str:
    return next(a for a in ARCHS if os.path.basename(model_dir).startswith((f"mtp_{a}", f"echo_{a}")))


def hf_model(model_dir: str):
    """transformers' model of a test checkpoint, float32 (MiMo's: Qwen2's class, its MTP layer ignored)."""
    config = hf_config(model_dir)
    cls = transformers.Qwen2ForCausalLM if config.model_type == "qwen2" else transformers.AutoModelForCausalLM
    return cls.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()


def test_mtp_layer_logits_follow_the_formula(mtp_dir):
    """Ours: the loaded layer over a 20-token sequence through the paged cache; reference: transformers'
    decoder-layer class on the same weights, h_i from transformers' model, the formula in torch."""
    arch = arch_of(mtp_dir)
    config = hf_config(mtp_dir)
    eps = config.rms_norm_eps
    prefix, (tnorm, hnorm, proj, fnorm, head, block) = layout(arch)
    tensors = {k[len(prefix):]: v for k, v in load_file(os.path.join(mtp_dir, "model.safetensors")).items()
               if k.startswith(prefix)}
    hf = hf_model(mtp_dir)
    ids = torch.tensor(make_prompts(config.vocab_size, [21], seed=5)[0])
    length = len(ids) - 1  # positions 0 .. L-1 take h_i and the token i + 1
    with torch.no_grad():
        h = hf.model(input_ids=ids[None, :length]).last_hidden_state[0]
        emb = hf.model.embed_tokens(ids[1:])
        emb[0] = 0
        parts = [rms(emb, tensors[f"{tnorm}.weight"], eps), rms(h, tensors[f"{hnorm}.weight"], eps)]
        x = torch.cat(parts[::-1] if arch == "mimo" else parts, -1) @ tensors[f"{proj}.weight"].T
        layer = LAYER_CLS[arch](config, layer_idx=0 if arch == "mimo" else config.num_hidden_layers).eval()
        sd = {k[len(block):]: v for k, v in tensors.items()
              if k.startswith(block) and k[len(block):].split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                           "post_attention_layernorm")}
        layer.load_state_dict(fused_experts(sd), strict=True)
        pos = torch.arange(length)[None]
        cos_sin = hf.model.rotary_emb(x[None], pos)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = rms((out[0] if isinstance(out, tuple) else out)[0], tensors[f"{fnorm}.weight"], eps)
        want = out @ (tensors[f"{head}.weight"] if head else hf.lm_head.weight).T

    llm = engine(mtp_dir, {"method": "mtp", "num_speculative_tokens": 1})
    mtp = llm.llm_engine.speculator.mtp
    bs = llm.llm_engine.config.cache_config.block_size
    cache = torch.zeros_like(mtp.cache)
    table = list(range(cdiv(length, bs)))
    meta = AttentionMetadata.build(torch.arange(length), [table], [length], [length], bs, "cpu")
    with torch.inference_mode():
        got = mtp.layer.compute_logits(mtp.layer(ids[1:], torch.arange(length), h, cache, meta))
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- the engine ------------------------------------------------------------------------------------------------
def test_greedy_with_random_mtp_equals_plain_decoding_and_transformers(mtp_dir):
    """A random MTP layer (proposals mostly wrong), k = 3, 16-token steps (chunked prefill), n = 2."""
    vocab = hf_config(mtp_dir).vocab_size
    ps = make_prompts(vocab, [3, 17, 40], seed=11)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hf = hf_model(mtp_dir)
    ref = [hf_greedy(hf, p, 16) for p in ps]
    llm = engine(mtp_dir, MTP, max_num_batched_tokens=16)
    got = llm.generate(ps, sp)
    assert [o.outputs[0].token_ids for o in got] == [r[0] for r in ref]
    want = engine(mtp_dir, max_num_batched_tokens=16).generate(ps, SamplingParams(temperature=0, max_tokens=16, n=2,
                                                                                ignore_eos=True))
    assert token_ids(llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True))) == \
        token_ids(want)
    st = llm.llm_engine.speculator.stats
    assert st.num_drafts > 10 and st.num_draft_tokens > 30
    assert_pool_empty(llm)
    mtp_state_empty(llm)


def test_start_up_line_and_unservable_requests(mtp_dir):
    """The start-up line names the method, the layer and k; requests with stop strings decode without
    proposals (said once), their output as without speculation."""
    with pagedllm_logs() as logs:
        llm = engine(mtp_dir, MTP)
        ps = make_prompts(hf_config(mtp_dir).vocab_size, [6, 14], seed=8)
        sp = SamplingParams(temperature=0, max_tokens=12, stop=["zzzz"], ignore_eos=True)
        got = llm.generate(ps, sp)
    line = [r.getMessage() for r in logs if r.getMessage().startswith("speculative decoding: mtp")]
    where = layout(arch_of(mtp_dir))[0].rstrip(".")
    assert len(line) == 1 and f"mtp (the checkpoint's multi-token-prediction layer ({where})), k=3" in line[0]
    assert sum("no proposals for requests with stop strings" in r.getMessage() for r in logs) == 1
    assert llm.llm_engine.speculator.stats.num_drafts == 0
    assert token_ids(got) == token_ids(engine(mtp_dir).generate(ps, sp))
    assert_pool_empty(llm)
    mtp_state_empty(llm)


def test_echo_mtp_is_accepted_and_changes_nothing(echo_dir):
    """An MTP layer that proposes the target's last prediction again: accepted wherever the output repeats
    a token (a logit bias makes it repeat); greedy output as without speculation, again with prefix-cache
    hits (the prompts twice)."""
    vocab = hf_config(echo_dir).vocab_size
    ps = make_prompts(vocab, [5, 19, 33, 8, 26, 12], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={20: 8.0})
    want = engine(echo_dir).generate(ps, sp)
    llm = engine(echo_dir, MTP)
    got = llm.generate(ps, sp)
    assert token_ids(got) == token_ids(want)
    st = llm.llm_engine.speculator.stats
    repeats = sum(a == b for o in want for a, b in zip(o.outputs[0].token_ids, o.outputs[0].token_ids[1:]))
    assert repeats > 20 and st.num_accepted_tokens > 0.3 * repeats
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens and st.accepted_per_pos[2] > 0
    assert_pool_empty(llm)
    mtp_state_empty(llm)
    # the prompts again: prefix-cache hits bring the MTP entries of their blocks along
    assert token_ids(llm.generate(ps, sp)) == token_ids(want)
    assert_pool_empty(llm)
    mtp_state_empty(llm)


def test_echo_mtp_under_preemption(echo_dir):
    vocab = hf_config(echo_dir).vocab_size
    ps = make_prompts(vocab, [5, 19, 33, 8, 26, 12], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logit_bias={20: 8.0})
    base = engine(echo_dir, max_model_len=128)
    per_block = base.llm_engine.executor.runner.bytes_per_block()
    want = base.generate(ps, sp)
    # the MTP layer's cache adds one layer a block: 12 blocks of both
    llm = engine(echo_dir, MTP, max_model_len=128, kv_cache_memory=12 * (per_block + per_block // 3))
    assert llm.llm_engine.config.cache_config.num_blocks == 12
    got = llm.generate(ps, sp)
    assert token_ids(got) == token_ids(want)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    assert_pool_empty(llm)
    mtp_state_empty(llm)


def test_sampled_tokens_follow_the_target_distribution(mtp_dir):
    """tests/test_spec_decode.py's chi-square check with the random MTP layer proposing."""
    llm = assert_sampled_distribution_unchanged(mtp_dir, MTP, min_accepted=50)
    mtp_state_empty(llm)
