"""Batch-1 decode of a random-weight GGUF model of a real shape: the weights kept in their ggml
blocks on our kernels (``PAGEDLLM_CPU_GGUF_KERNELS=1``) against the same file dequantized at load
(``=0``), each in its own process, alternated; with the memory floor (file bytes / measured read
bandwidth: ``torch.sum`` over 1 GiB of float32).

The file is written here without llama.cpp: Qwen2.5-1.5B's shape (``--shape``), every linear
weight ``--qtype`` (Q4_K or Q8_0) made of random blocks with small fp16 scales (the values do not
matter for speed), norms and q/k/v biases F32, token embedding Q4_K/Q8_0 and an untied output
matrix Q6_K (as in a Q4_K_M file), a byte-level BPE tokenizer (``model_shapes.build_tokenizer``).
``--qtype F16`` writes every matrix as random float16 (std 0.02): the input of llama.cpp's
``llama-quantize``, whose output (a Q4_K_M file of llama.cpp's own mix) ``--file`` then decodes.
``--tied``: no output matrix, the head tied to a Q6_K token embedding (a tied model's Q4_K_M, as Qwen2.5-1.5B's).

    pagedllm bench gguf-decode --qtype Q4_K --rounds 2 --tokens 32
    pagedllm bench gguf-decode --qtype F16 --write-only      # prints the F16 file's path
    llama-quantize bench_results/models/qwen2.5-1.5b-F16.gguf q4km.gguf Q4_K_M 2
    pagedllm bench gguf-decode --file q4km.gguf --rounds 2 --tokens 64

``--qtype GPTQ`` writes a GPTQ int4 checkpoint of the shape instead (a Hugging Face folder: config.json
with its ``quantization_config``, symmetric, group 128; random codes, small fp16 scales; embedding and
LM head float16), which the loader repacks into Q4_0 blocks for the same kernels (``=1``) or
dequantizes (``=0``): ``--shape qwen2-0.5b --qtype GPTQ``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch

from pagedllm.benchmarks.model_shapes import SHAPES, build_tokenizer, write_model_shape

_BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,))}


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / block * bytes] of random bytes, each fp16 scale a small random value; for
    ``F16``, float16 [rows, cols] of normal values (std 0.02), the input of ``llama-quantize``, drawn
    in slices of rows so that no float32 copy of a whole matrix is made (an 8B model's embedding is
    2.1 GB in float32)."""
    if qtype == "F16":
        out = np.empty((rows, cols), dtype=np.float16)
        step = max(1, (64 << 20) // (4 * cols))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            out[r:r + n] = rng.standard_normal((n, cols), dtype=np.float32) * 0.02
        return out
    elems, nbytes, halves = _BLOCK[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for off in halves:
        raw[:, :, off:off + 2] = (rng.uniform(1e-5, 1e-4, size=raw.shape[:2]).astype(np.float16)[..., None]
                                  .view(np.uint8))
    return raw.reshape(rows, -1)


def write_gguf(path: str, shape: str, qtype: str, tied: bool = False) -> str:
    """Write the random-weight ``shape`` model with ``qtype`` linear weights to ``path`` (once);
    ``tied``: no output matrix and a Q6_K token embedding (llama-quantize's Q4_K_M of a tied model)."""
    import gguf  # lazily: gguf, only to write the file

    if os.path.exists(path):
        return path
    spec = SHAPES[shape]
    h, layers, inter, vocab = spec["hidden_size"], spec["num_hidden_layers"], spec["intermediate_size"], spec["vocab_size"]
    nh, nkv = spec["num_attention_heads"], spec["num_key_value_heads"]
    hd = h // nh
    tok_dir = path + ".tokenizer"
    tok = build_tokenizer(tok_dir, vocab)
    data = json.loads(tok.backend_tokenizer.to_str())
    arch = spec["arch"]
    w = gguf.GGUFWriter(path + ".part", arch)
    w.add_name(f"random {shape} {qtype}")
    w.add_block_count(layers)
    w.add_context_length(spec["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(spec["rope_theta"])
    w.add_layer_norm_rms_eps(spec["rms_norm_eps"])
    w.add_vocab_size(vocab)
    vocab_list = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab_list])
    w.add_token_types([gguf.TokenType.NORMAL] * len(vocab_list))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    w.add_bos_token_id(tok.eos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    rng = np.random.default_rng(0)
    ones = np.ones(h, dtype=np.float32)
    # Streamed: every tensor is declared first (name, shape, type) and made only when its turn to be
    # written comes, so at most one matrix is in memory (gguf's add_tensor would hold all of them:
    # 16 GB for an 8B F16 file). The makers run in declaration order, so the rng's stream and the
    # bytes are those of a writer that made every tensor up front.
    makers = []

    def put(name, shape, dtype, nbytes, make, raw=None):
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
        makers.append(make)

    def vec(name, make, size):
        put(name, (size,), np.float32, size * 4, make)

    def q(name, rows, cols, t=qtype):
        make = lambda: random_blocks(rows, cols, t, rng)  # noqa: E731
        if t == "F16":
            put(name, (rows, cols), np.float16, rows * cols * 2, make)
        else:
            elems, nbytes, _ = _BLOCK[t]
            row_bytes = cols // elems * nbytes
            put(name, (rows, row_bytes), np.uint8, rows * row_bytes, make, gguf.GGMLQuantizationType[t])

    q("token_embd.weight", vocab, h, "Q6_K" if tied and qtype != "F16" and h % 256 == 0 else qtype)
    for i in range(layers):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", lambda: ones, h)
        q(b + "attn_q.weight", nh * hd, h)
        q(b + "attn_k.weight", nkv * hd, h)
        q(b + "attn_v.weight", nkv * hd, h)
        if arch == "qwen2":
            for n, size in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
                vec(b + n + ".bias", lambda size=size: rng.standard_normal(size).astype(np.float32) * 0.01, size)
        q(b + "attn_output.weight", h, nh * hd)
        vec(b + "ffn_norm.weight", lambda: ones, h)
        q(b + "ffn_gate.weight", inter, h)
        q(b + "ffn_up.weight", inter, h)
        q(b + "ffn_down.weight", h, inter)
    vec("output_norm.weight", lambda: ones, h)
    if not tied:
        q("output.weight", vocab, h, "F16" if qtype == "F16" else "Q6_K" if h % 256 == 0 else "Q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(make())
    w.close()
    os.replace(path + ".part", path)
    return path


def write_gptq(out_dir: str, shape: str, group: int = 128) -> str:
    """Write the random-weight ``shape`` model as a GPTQ int4 checkpoint (symmetric, ``group``) into
    ``out_dir`` (once): ``int4_formats``' GPTQ layout, qzeros 0x77777777 (v1: z - 1 = 7)."""
    from safetensors.torch import save_file  # lazily: only to write the checkpoint

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    write_model_shape(out_dir, shape)
    spec = SHAPES[shape]
    h, layers, inter, vocab = spec["hidden_size"], spec["num_hidden_layers"], spec["intermediate_size"], spec["vocab_size"]
    hd = h // spec["num_attention_heads"]
    q_out, kv_out = spec["num_attention_heads"] * hd, spec["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (torch.randn(vocab, h, generator=gen) * 0.02).half(),
               "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    if not spec["tie_word_embeddings"]:
        tensors["lm_head.weight"] = (torch.randn(vocab, h, generator=gen) * 0.02).half()

    def linear(name: str, n: int, k: int) -> None:
        groups = -(-k // group)
        tensors[name + ".qweight"] = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
        tensors[name + ".qzeros"] = torch.full((groups, n // 8), 0x77777777, dtype=torch.int32)
        tensors[name + ".scales"] = (torch.rand(groups, n, generator=gen) * 9e-4 + 1e-4).half()
        tensors[name + ".g_idx"] = (torch.arange(k) // group).int()

    for i in range(layers):
        b = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[b + n + ".weight"] = torch.ones(h, dtype=torch.float16)
        for n, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            linear(b + "self_attn." + n, rows, h)
            if spec["arch"] == "qwen2":
                tensors[b + "self_attn." + n + ".bias"] = (torch.randn(rows, generator=gen) * 0.01).half()
        linear(b + "self_attn.o_proj", h, q_out)
        linear(b + "mlp.gate_proj", inter, h)
        linear(b + "mlp.up_proj", inter, h)
        linear(b + "mlp.down_proj", h, inter)
    save_file(tensors, os.path.join(out_dir, "model.safetensors.part"))
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                  "desc_act": False, "checkpoint_format": "gptq"}
    cfg["torch_dtype"] = "float16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(os.path.join(out_dir, "model.safetensors.part"), os.path.join(out_dir, "model.safetensors"))
    return out_dir


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of ``torch.sum`` over ``gib`` GiB of float32 (best of ``repeats``; torch's threads)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_one(path: str, tokens: int, prompt_len: int) -> dict:
    """In this process: load ``path``, decode ``tokens`` at batch 1; tok/s and memory."""
    from pagedllm import LLM, SamplingParams  # lazily: the engine, only in the measuring child

    base = _rss_mib()
    t = time.perf_counter()
    if os.path.isdir(path):  # a GPTQ folder holds its tokenizer
        tokenizer = path
    else:
        tokenizer = path + ".tokenizer" if os.path.isdir(path + ".tokenizer") else None  # else the file's own
    llm = LLM(path, tokenizer=tokenizer, max_model_len=prompt_len + tokens + 16,
              kv_cache_memory=64 << 20, max_num_seqs=1)
    load_s = time.perf_counter() - t
    loaded = _rss_mib()
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)  # warm-up
    t1 = min(_timed(lambda: llm.generate([prompt], one, use_tqdm=False)) for _ in range(2))
    tn = _timed(lambda: llm.generate([prompt], many, use_tqdm=False))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tok_s": tokens / (tn - t1), "ms_per_token": (tn - t1) / tokens * 1e3, "load_s": load_s,
            "rss_after_load_mib": loaded - base, "peak_rss_mib": peak, "rss_at_import_mib": base}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--qtype", default="Q4_K", choices=["Q4_K", "Q8_0", "F16", "GPTQ"],
                   help="type of the written file's matrices (F16: the input of llama-quantize), or GPTQ: "
                        "an int4 GPTQ checkpoint folder")
    p.add_argument("--file", default=None, help="decode this GGUF file instead of writing one (e.g. "
                                                "llama-quantize's output)")
    p.add_argument("--write-only", action="store_true", help="write the file, print its path and stop")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="alternated kernels/dequantized rounds")
    p.add_argument("--paths", nargs="+", default=["blocks", "dequantized"], choices=["blocks", "dequantized"],
                   help="which paths each round runs, in this order")
    p.add_argument("--tied", action="store_true",
                   help="GGUF: no output matrix, the LM head tied to a Q6_K token embedding (as a tied model's Q4_K_M)")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> None:
    if a.child:
        print("RESULT " + json.dumps(run_one(a.path, a.tokens, a.prompt_len)), flush=True)
        return
    if a.file is not None:
        if not os.path.isfile(a.file):
            raise SystemExit(f"pagedllm bench gguf-decode: error: no GGUF file at {a.file!r}")
        path = a.file
    else:
        os.makedirs(os.path.join(a.output_dir, "models"), exist_ok=True)
        if a.qtype == "GPTQ":
            path = write_gptq(os.path.join(a.output_dir, "models", f"{a.shape}-GPTQ"), a.shape)
        else:
            tag = "-tied" if a.tied else ""
            path = write_gguf(os.path.join(a.output_dir, "models", f"{a.shape}-{a.qtype}{tag}.gguf"), a.shape,
                              a.qtype, a.tied)
        if a.write_only:
            print(path)
            return
    size = os.path.getsize(os.path.join(path, "model.safetensors") if os.path.isdir(path) else path)
    bw = read_bandwidth()
    print(f"file {size / 2**20:.1f} MiB; read bandwidth {bw:.1f} GB/s; floor {size / bw / 1e6:.1f} ms a token "
          f"({bw * 1e9 / size:.1f} tok/s)", flush=True)
    rows = []
    for r in range(a.rounds):
        for kernels in ["1" if which == "blocks" else "0" for which in a.paths]:
            env = {**os.environ, "PAGEDLLM_CPU_GGUF_KERNELS": kernels}
            cmd = [sys.executable, "-m", "pagedllm.benchmarks.cli", "bench", "gguf-decode", "--child", "--path", path,
                   "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
            res = {"round": r, "kernels": kernels == "1", **json.loads(line[7:])}
            rows.append(res)
            print(f"round {r} {'blocks+kernels' if res['kernels'] else 'dequantized  '}: {res['tok_s']:.2f} tok/s "
                  f"({res['ms_per_token']:.1f} ms) | load {res['load_s']:.1f} s | RSS after load "
                  f"+{res['rss_after_load_mib']:.0f} MiB, peak {res['peak_rss_mib']:.0f} MiB", flush=True)
    result = {"file": path, "shape": a.shape, "qtype": a.qtype, "file_bytes": size, "read_gb_s": bw, "rows": rows}
    name = os.path.basename(path).removesuffix(".gguf") if a.file else f"{a.shape}_{a.qtype}"
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, f"gguf_decode_{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
