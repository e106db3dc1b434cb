"""CUDA graphs of decode steps (pagedllm/platforms/cuda/graph_runner.py), their bookkeeping tested on the CPU:
the capture ladder, padding to the next captured size, persistent buffers reused step after step, which
steps run eagerly and why; the capture itself stubbed by a fake graph whose replay runs the model eagerly
on the padded buffers (the real capture needs CUDA: scripts/device_check.sh). Also ``--enforce-eager``,
and the optional flash-attn / flashinfer backends: refusing where their library is missing, and passing a step
as each library reads it (a pure-torch stand-in of the library, against the torch reference)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import assert_pool_empty

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.attention import AttentionMetadata, kv_quant
from pagedllm.layers.attention.flash_attn_backend import FlashAttnPagedAttention, unsupported_features
from pagedllm.layers.attention.flashinfer_backend import FlashInferPagedAttention, page_list
from pagedllm.layers.attention.selector import ATTENTION_BACKENDS, get_attention_backend
from pagedllm.layers.attention.torch_backend import TorchPagedAttention
from pagedllm.platforms.cuda import graph_runner as gr
from pagedllm.platforms.cuda.graph_runner import CudaGraphRunner, DecodeBuffers, capture_sizes, padded_size


class FakeGraph:
    """Stands in for a captured CUDA graph: capture runs ``fn`` once and keeps its output tensor; replay
    runs ``fn`` again (eagerly, on whatever the buffers hold now) into that same tensor, as a replay
    rewrites the captured output in place."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


# ---- the ladder and the reasons ---------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (32, [1, 2, 4, 8, 16, 24, 32]), (256, [1, 2, 4] + list(range(8, 257, 8))),
    (1024, [1, 2, 4] + list(range(8, 513, 8))),  # capped at vLLM's 512
])
def test_capture_ladder(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_ladder_refuses_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("n, expected", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, 24), (255, 256), (256, 256),
                                         (257, None)])
def test_padded_size(n, expected):
    assert padded_size(capture_sizes(256), n) == expected


def test_graphs_off_reasons():
    ok = dict(device="cuda", enforce_eager=False, backend_name="triton")
    assert gr.graphs_off_reason(**ok) is None
    assert gr.graphs_off_reason(**{**ok, "backend_name": "flash-attn"}) is None
    assert gr.graphs_off_reason(**{**ok, "device": "cpu"}) == "not a CUDA device"
    assert gr.graphs_off_reason(**{**ok, "enforce_eager": True}) == "--enforce-eager"
    assert "'torch' is not graph-safe" in gr.graphs_off_reason(**{**ok, "backend_name": "torch"})
    assert "'flashinfer' is not graph-safe" in gr.graphs_off_reason(**{**ok, "backend_name": "flashinfer"})
    assert "world size 2" in gr.graphs_off_reason(**ok, world_size=2)
    assert "pooling" in gr.graphs_off_reason(**ok, pooling=True)


def test_enforce_eager_is_a_setting():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).enforce_eager is False
    assert EngineArgs(enforce_eager=True).create_engine_config().model_config.enforce_eager is True


# ---- the runner on a toy forward --------------------------------------------------------------------
def _toy_runner(sizes, max_blocks=4, block_size=8, pad_block=9):
    buffers = DecodeBuffers(sizes[-1], max_blocks, block_size, pad_block, "cpu")
    calls = []

    def forward(b):  # one output row per buffer row, from every input the step loaded
        calls.append(b)
        return torch.stack([buffers.input_ids[:b].float(), buffers.positions[:b].float(),
                            buffers.slot_mapping[:b].float(), buffers.seq_lens[:b].float(),
                            buffers.block_tables[:b].float().sum(1)], 1)

    runner = CudaGraphRunner(sizes, buffers, forward, FakeGraph)
    runner.capture()
    return runner, buffers, calls


def _decode_step(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, 100, (n,), generator=g), positions=torch.randint(0, 30, (n,), generator=g),
                slot_mapping=torch.randint(0, 72, (n,), generator=g),
                block_tables=torch.randint(0, 9, (n, width), generator=g, dtype=torch.int32),
                seq_lens=torch.randint(1, 30, (n,), generator=g, dtype=torch.int32))


def test_runner_pads_reuses_buffers_and_falls_back():
    runner, buffers, calls = _toy_runner([1, 2, 4, 8])
    assert calls == [8, 4, 2, 1]  # captured largest first, each once
    ptrs = {name: getattr(buffers, name).data_ptr()
            for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")}
    out_ptr = runner.outputs[8].data_ptr()
    for step, (n, width) in enumerate([(5, 3), (7, 4), (6, 1)]):  # all pad to 8
        s = _decode_step(n, width, step)
        rows = torch.tensor([n - 1, 0, 2])  # logits_indices: any rows, in any order
        out = runner.run(**s, num_decodes=n, logits_indices=rows)
        table_sums = torch.cat([s["block_tables"].float().sum(1), torch.full((8 - n,), 9.0)])
        full = torch.stack([torch.cat([s["input_ids"].float(), torch.zeros(8 - n)]),
                            torch.cat([s["positions"].float(), torch.zeros(8 - n)]),
                            torch.cat([s["slot_mapping"].float(), torch.full((8 - n,), 72.0)]),  # pad slot 9 * 8
                            torch.cat([s["seq_lens"].float(), torch.ones(8 - n)]), table_sums], 1)
        assert torch.equal(out, full[rows])
        assert torch.equal(buffers.block_tables[:n, width:], torch.zeros(n, 4 - width, dtype=torch.int32))
        assert torch.equal(buffers.block_tables[n:8, 0], torch.full((8 - n,), 9, dtype=torch.int32))
        assert out.data_ptr() != out_ptr  # the caller gets its own rows
    assert runner.replays == {8: 3} and not runner.eager_steps
    assert {name: getattr(buffers, name).data_ptr() for name in ptrs} == ptrs
    assert runner.outputs[8].data_ptr() == out_ptr
    assert buffers.query_start_loc.tolist() == list(range(9))

    s = _decode_step(9, 2, 7)  # over the largest size
    assert runner.run(**s, num_decodes=9, logits_indices=torch.arange(9)) is None
    s = _decode_step(3, 5, 8)  # a table wider than the buffer's
    assert runner.run(**s, num_decodes=3, logits_indices=torch.arange(3)) is None
    s = _decode_step(4, 2, 9)  # 3 decodes and a prefill (4 tokens in 4 rows cannot be one, but the count says so)
    assert runner.run(**s, num_decodes=3, logits_indices=torch.arange(3)) is None
    assert runner.eager_steps == {gr.TOO_LARGE: 1, gr.TOO_WIDE: 1, gr.PREFILL: 1}
    assert runner.replays == {8: 3}


# ---- the runner in the engine, against eager steps --------------------------------------------------
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING RICHARD III:\nNow is the winter", "HAMLET:", "MERCUTIO:\nNay, I'll", "NURSE:", "LADY CAPULET:",
           "What light", "But soft", "To be, or not"]


def _llm(graphs: bool, **kw):
    llm = LLM(attention_backend="torch", device="cpu", kv_cache_memory=4 << 20, max_num_seqs=16, max_model_len=128,
              **kw)
    runner = llm.llm_engine.executor.runner
    steps = []
    inner = runner.execute_model

    def execute_model(model_input):  # every step's layout and output
        out = inner(model_input)
        meta = model_input.attn_metadata
        steps.append((meta.num_decode_tokens, len(meta.prefills), out.clone()))
        return out

    runner.execute_model = execute_model
    if graphs:  # what allocate_kv_cache does on CUDA, with the capture stubbed
        assert runner.graphs_off == "not a CUDA device" and runner.cuda_graphs is None
        runner.graphs_off, runner.graph_factory = None, lambda: FakeGraph
        num_blocks = llm.llm_engine.config.cache_config.num_blocks
        runner.allocate_kv_cache(num_blocks)
        assert runner.kv_caches[0].shape[1] == num_blocks + 1  # + the scratch block of the padding rows
        assert runner.cuda_graphs.sizes == [1, 2, 4, 8, 16]
    return llm, runner, steps


def _generate(llm, prompts, max_tokens=5):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_padded_replay_equals_the_eager_step():
    eager, _, eager_steps = _llm(False)
    graphs, runner, graph_steps = _llm(True)
    forwards = []  # the input_ids tensor of every forward the model runs
    model_forward = runner.model.forward
    runner.model.forward = lambda ids, *a, **k: (forwards.append(ids.data_ptr()), model_forward(ids, *a, **k))[1]
    buffers = runner.cuda_graphs.buffers
    ptrs = (buffers.input_ids.data_ptr(), buffers.slot_mapping.data_ptr(), buffers.block_tables.data_ptr())
    for n in (3, 5, 11):  # between the rungs 2-4, 4-8, 8-16
        assert _generate(graphs, PROMPTS[:n]) == _generate(eager, PROMPTS[:n])
    assert len(graph_steps) == len(eager_steps)
    for (nd, np_, out), (nd_e, np_e, out_e) in zip(graph_steps, eager_steps):
        assert (nd, np_) == (nd_e, np_e) and out.shape == out_e.shape
        # padding changes the batch of every matmul (and the graph gathers the context up to max_model_len), so
        # the rows agree to rounding, not bit for bit
        torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-4)
    decode_steps = sum(1 for nd, np_, _ in graph_steps if np_ == 0)
    assert runner.cuda_graphs.replays == {4: 4, 8: 4, 16: 4} and decode_steps == 12
    assert runner.cuda_graphs.eager_steps[gr.PREFILL] == len(graph_steps) - decode_steps
    assert forwards.count(buffers.input_ids.data_ptr()) == 12  # every replay ran on the persistent buffers
    assert (buffers.input_ids.data_ptr(), buffers.slot_mapping.data_ptr(), buffers.block_tables.data_ptr()) == ptrs
    assert_pool_empty(graphs)


def test_steps_with_prefills_run_eagerly():
    # A short prompt decodes while a long one is still prefilled in chunks of the 16-token budget.
    kw = dict(max_num_batched_tokens=16, enable_prefix_caching=False)
    eager, _, eager_steps = _llm(False, **kw)
    graphs, runner, graph_steps = _llm(True, **kw)
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak. All: Speak, speak."]
    assert _generate(graphs, prompts, 8) == _generate(eager, prompts, 8)
    mixed = [s for s in graph_steps if s[0] and s[1]]
    assert mixed, "no step held a decode and a prefill"
    replayed = sum(1 for nd, np_, _ in graph_steps if np_ == 0)
    assert sum(runner.cuda_graphs.replays.values()) == replayed
    assert runner.cuda_graphs.eager_steps == {gr.PREFILL: len(graph_steps) - replayed}
    for (_, _, out), (_, _, out_e) in zip(graph_steps, eager_steps):
        torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or "triton" not in ATTENTION_BACKENDS,
                    reason="needs CUDA and the triton attention backend (scripts/device_check.sh runs it)")
def test_captured_graphs_equal_eager_on_cuda():
    runs = {}
    for eager in (True, False):
        llm = LLM(attention_backend="triton", device="cuda", dtype="float32", kv_cache_memory=64 << 20,
                  max_num_seqs=16, max_model_len=128, enforce_eager=eager)
        runs[eager] = _generate(llm, PROMPTS[:11], 8)
        runner = llm.llm_engine.executor.runner
        if eager:
            assert runner.cuda_graphs is None and runner.graphs_off == "--enforce-eager"
        else:
            assert runner.cuda_graphs is not None and runner.cuda_graphs.replays[16] == 7
        llm.llm_engine.shutdown()
    assert runs[False] == runs[True]


# ---- the optional library backends ------------------------------------------------------------------
SETUP = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256)


@pytest.mark.parametrize("name, cls, library, reason", [
    ("flash-attn", FlashAttnPagedAttention, "flash_attn", "flash_attn is not installed (pip install flash-attn)"),
    ("flashinfer", FlashInferPagedAttention, "flashinfer",
     "flashinfer is not installed (pip install flashinfer-python)"),
])
def test_library_backends_refuse_without_their_library(name, cls, library, reason):
    if importlib.util.find_spec(library) is not None:
        pytest.skip(f"{library} is installed here")
    assert ATTENTION_BACKENDS[name].endswith(cls.__name__)
    assert cls.unsupported_reason(**SETUP) == reason
    with pytest.raises(ValueError, match=re.escape(f"attention backend '{name}' cannot run this setup: {reason}")):
        get_attention_backend(name, **SETUP)


@pytest.mark.parametrize("cls, library", [(FlashAttnPagedAttention, "flash_attn"),
                                          (FlashInferPagedAttention, "flashinfer")])
def test_library_backends_refuse_setups_by_name(cls, library, monkeypatch):
    # With the library "installed" (its spec found), the checks before any import of it: device, dtype, head_dim.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == library else real(n, *a))
    assert cls.unsupported_reason(**{**SETUP, "device": "cpu"}) == f"{library} runs on CUDA only"
    assert "not float32" in cls.unsupported_reason(**{**SETUP, "dtype": torch.float32})
    odd = 80 if cls is FlashInferPagedAttention else 260
    assert cls.unsupported_reason(**{**SETUP, "head_dim": odd}).endswith(f"not {odd}")
    if cls is FlashAttnPagedAttention:
        assert "multiple of 256 (got 16" in cls.unsupported_reason(**{**SETUP, "block_size": 16})


def test_library_backends_refuse_features_by_name():
    cache = torch.zeros(2, 3, 4, 1, 8)
    assert unsupported_features(cache, None, None) is None
    assert unsupported_features(None, None, None).startswith("a step without a KV cache")
    assert "int8" in unsupported_features(torch.zeros(2, 3, kv_quant.block_rows(4, 8, "int8"), 1, 8,
                                                      dtype=torch.int8), None, None)
    assert "one-plane" in unsupported_features(cache[:1], None, None)
    assert "sinks" in unsupported_features(cache, torch.zeros(2), None)
    assert "chunked" in unsupported_features(cache, None, 8)


def test_flashinfer_page_list():
    # 2 decodes (seq_lens 5, 8) and a prefill of 3 tokens over a 6-token prefix (seq_len 9), block size 4.
    meta = AttentionMetadata.build(torch.zeros(5, dtype=torch.long), [[7, 2], [4, 0, 5], [1, 6, 3]], [5, 8, 9],
                                   [1, 1, 3], 4, "cpu")
    qo, kv_indptr, kv_indices, last = page_list(meta)
    assert qo.tolist() == [0, 1, 2, 5]
    assert kv_indptr.tolist() == [0, 2, 4, 7]
    assert kv_indices.tolist() == [7, 2, 4, 0, 1, 6, 3]
    assert last.tolist() == [1, 4, 1]
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, kv_indices, last))


# ---- scripts/device_check.sh and its driver ---------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "scripts", "device_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def test_device_check_sh_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "device_check.sh")], check=True)


def test_driver_arguments(driver):
    a = driver.parse_args([])
    assert (a.shapes, a.backends, a.batches, a.device, a.dtype) == (["qwen2-0.5b", "llama-3-8b"], ["triton", "torch"],
                                                                    [64, 256], "cuda", "bfloat16")
    d = driver.parse_args(["--dry-run", "--batches", "3, 5", "--shapes", "llama-tiny"])
    assert (d.shapes, d.backends, d.batches, d.device, d.prompt_len) == (["llama-tiny"], ["torch"], [3, 5], "cpu", 8)
    with pytest.raises(SystemExit):
        driver.parse_args(["--batches", "0"])


def test_driver_floor_arithmetic(driver):
    from pagedllm.benchmarks.model_shapes import SHAPES

    s = SHAPES["llama-3-8b"]
    h, inter, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv_dim = h // s["num_attention_heads"] * s["num_key_value_heads"]
    params = 2 * v * h + layers * (2 * h * h + 2 * h * kv_dim + 3 * h * inter + 2 * h) + h
    assert params == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    read = driver.step_weight_bytes(2 * params, v, h, tied=False, dtype_bytes=2)
    assert read == 2 * params - 2 * v * h  # the input embedding is not read whole
    assert driver.step_weight_bytes(1000, 10, 10, tied=True, dtype_bytes=2) == 1000
    kv_per_token = layers * 2 * kv_dim * 2  # K and V, bf16: 128 KiB
    assert kv_per_token == 128 * 1024
    # 4.8 TB/s: 15.01 GB of weights and 128 tokens of K/V (16 MiB) -> 3.13 ms a token
    floor = driver.hbm_floor_ms(read, kv_per_token, 128, 4.8e12)
    assert floor == pytest.approx(1e3 * (read + 128 * kv_per_token) / 4.8e12) and 3.1 < floor < 3.2


def test_driver_table_and_targets(driver):
    rows = [driver.Row("llama-3-8b", "triton", "on", 3.9, 3.13, {64: 1800.0, 256: 5000.0}),
            driver.Row("qwen2-0.5b", "triton", "off", 1.5, 0.22, {256: 12000.0}),
            driver.Row("qwen2-0.5b", "torch", "-", error="ValueError: no such backend")]
    table = driver.format_table(rows, [64, 256]).splitlines()
    assert table[0].split() == ["shape", "backend", "graphs", "b1", "ms/tok", "floor", "ms", "x", "floor", "tok/s",
                                "b64", "tok/s", "b256"]
    assert table[2].split() == ["llama-3-8b", "triton", "on", "3.90", "3.130", "1.25", "1800", "5000"]
    assert table[3].split()[-2:] == ["-", "12000"]
    assert table[4].endswith("error: ValueError: no such backend")
    assert len({len(line) for line in table[:4]}) == 1  # aligned
    checks = driver.targets(rows, {"llama": "equal", "qwen2": "equal", "gemma2": "differ in 1 of 5 sequences"})
    assert [ok for _, ok, _ in checks] == [True, True, False]
    assert [ok for _, ok, _ in driver.targets([], {})] == [None, None, None]


def test_driver_dry_run(driver, tmp_path):
    lines = []
    out = tmp_path / "check.json"
    # the second backend is swapped into the same engine (use_backend): here the same one again
    args = ["--dry-run", "--shapes", "llama-tiny", "--backends", "torch,torch", "--batches", "2", "--json", str(out)]
    assert driver.main(args, lines.append) == 0
    text = "\n".join(lines)
    assert "llama-tiny  torch    off (not a CUDA device)" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["graphs"] for r in rows] == ["off (not a CUDA device)", "off"]
    assert all(r["b1_ms"] > 0 and r["floor_ms"] > 0 and r["tok_s"]["2"] > 0 and not r["error"] for r in rows)


# ---- the library backends' plumbing, against a pure-torch stand-in of each library ------------------
def _ref_attention(q, k, v, scale, left, cap):
    """q [T, H, D] at the last T of L key positions, k/v [L, Hkv, D]; ``left`` keys to the left (-1: all)."""
    t, h, _ = q.shape
    length, hkv = k.shape[:2]
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("thd,lhd->htl", q.float(), k.float()) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(length - t, length).view(t, 1)
    kpos = torch.arange(length).view(1, length)
    mask = (kpos <= qpos) & ((kpos >= qpos - left) if left >= 0 else True)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), v.float()).to(q.dtype)


def _pages(cache, table, length):
    """The first ``length`` tokens of a sequence whose pages are ``table``: [length, Hkv, D]."""
    return cache[table.long()].flatten(0, 1)[:length]


class FakeFlashAttn:
    """flash_attn's two paged entries, as documented (bottom-right causal alignment, window (left, right))."""

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal,
                                window_size, softcap):
        assert causal and window_size[1] in (0, -1) and q.shape[1] == 1
        return torch.stack([_ref_attention(q[b], _pages(k_cache, block_table[b], int(n)),
                                           _pages(v_cache, block_table[b], int(n)), softmax_scale, window_size[0],
                                           softcap) for b, n in enumerate(cache_seqlens)])

    @staticmethod
    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_size, softcap, block_table):
        assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        out = torch.empty_like(q)
        for i in range(block_table.shape[0]):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            n = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            assert qe - qs <= max_seqlen_q and n <= max_seqlen_k
            out[qs:qe] = _ref_attention(q[qs:qe], _pages(k, block_table[i], n), _pages(v, block_table[i], n),
                                        softmax_scale, window_size[0], softcap)
        return out


class FakeFlashInfer:
    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, layout):
            assert layout == "NHD"

        def plan(self, qo_indptr, kv_indptr, kv_indices, last_len, hq, hkv, d, page, *, causal, sm_scale,
                 window_left, logits_soft_cap, q_data_type, kv_data_type):
            assert causal
            self.args = (qo_indptr, kv_indptr, kv_indices, last_len, page, sm_scale, window_left, logits_soft_cap)

        def run(self, q, kv):
            qo, kv_indptr, kv_indices, last_len, page, scale, left, cap = self.args
            out = torch.empty_like(q)
            for i in range(qo.shape[0] - 1):
                pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
                n = (pages.shape[0] - 1) * page + int(last_len[i])
                out[qo[i]:qo[i + 1]] = _ref_attention(q[qo[i]:qo[i + 1]], _pages(kv[0], pages, n),
                                                      _pages(kv[1], pages, n), scale, left, cap)
            return out


@pytest.mark.parametrize("cls, fake", [(FlashAttnPagedAttention, FakeFlashAttn),
                                       (FlashInferPagedAttention, FakeFlashInfer)])
@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
def test_library_backends_pass_the_step_as_the_libraries_read_it(cls, fake, window, cap, monkeypatch):
    # 2 decodes and 2 prefills (one over a cached prefix), block size 4, GQA 2, shuffled blocks: the same
    # attention as the torch reference when the library computes what its documentation says.
    module = importlib.import_module(cls.__module__)
    monkeypatch.setattr(module, "_library", lambda: fake)
    g = torch.Generator().manual_seed(0)
    bs, hkv, h, d = 4, 2, 4, 8
    seq_lens, query_lens = [7, 3, 9, 5], [1, 1, 4, 5]
    perm = torch.randperm(16, generator=g).tolist()
    tables = [perm[0:2], perm[2:3], perm[3:6], perm[6:8]]
    slots = [tables[i][p // bs] * bs + p % bs
             for i in range(4) for p in range(seq_lens[i] - query_lens[i], seq_lens[i])]
    meta = AttentionMetadata.build(torch.tensor(slots), tables, seq_lens, query_lens, bs, "cpu")
    n = sum(query_lens)
    q, k, v = (torch.randn(n, hh, d, generator=g) for hh in (h, hkv, hkv))
    cache = torch.randn(2, 16, bs, hkv, d, generator=g)  # the prefixes' K/V, and garbage elsewhere
    ref_cache = cache.clone()
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    out = cls().forward(q, k, v, cache, meta, 0.3, **kw)
    ref_meta = AttentionMetadata.build(torch.tensor(slots), tables, seq_lens, query_lens, bs, "cpu")
    expected = TorchPagedAttention().forward(q, k, v, ref_cache, ref_meta, 0.3, **kw)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, ref_cache)  # the step's K/V written to the same slots
