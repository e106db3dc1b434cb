"""Paged attention on the CPU through a small C++/OpenMP kernel (``platforms/cpu/paged_attention.cpp``) that
reads K/V in place through the block table: no per-layer gather of the context, grouped-query
attention without expanding K/V, online softmax over blocks, fp32 and bf16 (fp32 accumulation),
over a cache in the model's dtype or int8 (``kv_quant.py``).

The kernel is compiled on first use with the host's C++ compiler and loaded with ctypes
(``platforms/cpu/attention.py``, built by ``platforms/cpu/build.py``: no torch headers, so neither
ninja nor a torch build requirement). Where it cannot be built (no compiler) the selector falls back to the torch reference and logs why.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from pagedllm.layers.attention import kv_quant
from pagedllm.layers.attention.backend import AttentionBackend, write_kv
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.torch_backend import TorchPagedAttention, flat_cache, gather_rows
from pagedllm.platforms.cpu.attention import MAX_HEAD_DIM, SUPPORTED_DTYPES, _SUFFIX, check_operand as _check, load_kernel


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None,
                    max_query_len: int = 0, sinks: Optional[torch.Tensor] = None,
                    attention_chunk: Optional[int] = None) -> torch.Tensor:
    """out [N, H, D] <- attention of q [N, H, D] over the paged ``kv_cache``
    [2, num_blocks, block_size, Hkv, D] in q's dtype (or int8 [2, num_blocks, block_size + S, Hkv, D],
    ``kv_quant.py``) for
    the sequences of ``meta``; the step's new K/V must already be in the cache. Rows of sequences
    with more than ``max_query_len`` new tokens (when > 0) are left untouched. Raises ValueError on
    a shape, dtype or layout mismatch. ``sinks`` [H] float32: attention sinks (gpt-oss; see
    ``AttentionBackend``); ``attention_chunk``: Llama 4's chunked attention (not with a window)."""
    lib, err = load_kernel()
    if lib is None:
        raise RuntimeError(f"cpu paged-attention kernel unavailable: {err}")
    n, h, d = q.shape
    _, num_blocks, rows, hkv, d_cache = kv_cache.shape
    _check(q, "q", q.dtype, 3)
    _check(out, "out", q.dtype, 3)
    int8 = kv_quant.is_int8(kv_cache)
    _check(kv_cache, "kv_cache", torch.int8 if int8 else q.dtype, 5)
    bt, sl, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc
    if "cpu.checked" not in meta.derived:  # the step's metadata: checked by its first layer
        _check(bt, "block_tables", torch.int32, 2)
        _check(sl, "seq_lens", torch.int32, 1)
        _check(qsl, "query_start_loc", torch.int32, 1)
        meta.derived["cpu.checked"] = True
    b = sl.shape[0]
    if (d_cache != d or h % hkv or out.shape != q.shape or bt.shape[0] != b
            or rows != kv_quant.block_rows(meta.block_size, d, "int8" if int8 else "auto")
            or qsl.shape[0] != b + 1 or kv_cache.shape[0] not in (1, 2) or q.dtype not in SUPPORTED_DTYPES):
        raise ValueError(f"cpu paged attention: inconsistent shapes q {tuple(q.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, block_tables {tuple(bt.shape)}, seq_lens {tuple(sl.shape)}, "
                         f"query_start_loc {tuple(qsl.shape)}, block_size {meta.block_size}")
    if sinks is not None:
        _check(sinks, "sinks", torch.float32, 1)
        if sinks.shape[0] != h:
            raise ValueError(f"cpu paged attention: sinks {tuple(sinks.shape)} for {h} query heads")
    fn = getattr(lib, f"paged_attention_{_SUFFIX[q.dtype]}{'_i8' if int8 else ''}")
    # bytes from the K half to the V half (0: a one-plane cache, whose keys are the values)
    half = kv_cache.stride(0) * kv_cache.element_size() * (kv_cache.shape[0] - 1)
    args = (q.data_ptr(), kv_cache.data_ptr(), kv_cache.data_ptr() + half, out.data_ptr(), bt.data_ptr(),
            bt.stride(0), sl.data_ptr(), qsl.data_ptr(), b, h, hkv, d, meta.block_size, float(scale),
            -int(attention_chunk) if attention_chunk else int(sliding_window or 0), float(logits_soft_cap or 0.0),
            int(max_query_len),
            sinks.data_ptr() if sinks is not None else None)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("pagedllm::paged_attention_cpu"):  # an op of its own in profiles
            fn(*args)
    else:
        fn(*args)
    return out


def _check_rows(rows: int, block_size: int, d: int, int8: bool) -> None:
    """The int8 kernels lay a block out from ``block_size``: a cache of other rows per block must fail here."""
    if rows != kv_quant.block_rows(block_size, d, "int8" if int8 else "auto"):
        raise ValueError(f"cpu paged attention: a cache block of {rows} rows does not fit block_size {block_size}"
                         f" (head_dim {d}, {'int8' if int8 else 'model dtype'})")


def write_kv_c(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               block_size: int) -> None:
    """``backend.write_kv`` in one C call (an int8 cache: quantized, the same bytes as the torch
    reference; else copied); k/v [N, Hkv, D] with free token strides (views of the fused qkv
    output); ``block_size``: the step's (``AttentionMetadata.block_size``). Falls back to
    ``write_kv`` for any other layout."""
    lib, _ = load_kernel()
    n, hkv, d = k.shape
    int8 = kv_quant.is_int8(kv_cache)
    if kv_cache.shape[0] == 1:  # one plane: the keys are the values
        v = k
    if (lib is None or k.dtype not in _SUFFIX or v.dtype != k.dtype or not kv_cache.is_contiguous()
            or (not int8 and kv_cache.dtype != k.dtype) or kv_cache.shape[-2:] != (hkv, d) or v.shape != k.shape
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or any(t.stride(1) != d or t.stride(2) != 1 for t in (k, v))):
        write_kv(k, v, kv_cache, slot_mapping)
        return
    half = kv_cache.stride(0) * kv_cache.element_size() * (kv_cache.shape[0] - 1)  # one plane: V is K
    ptrs = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), n, hkv, d)
    if int8:  # (a cache in the model's dtype is written by flat slot: no block layout to check)
        _check_rows(kv_cache.shape[2], block_size, d, True)
        getattr(lib, f"kv_write_int8_{_SUFFIX[k.dtype]}")(*ptrs, block_size, kv_cache.data_ptr(),
                                                          kv_cache.data_ptr() + half)
    else:
        getattr(lib, f"kv_write_{_SUFFIX[k.dtype]}")(*ptrs, kv_cache.data_ptr(), kv_cache.data_ptr() + half)


def gather_kv(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, *, block_size: int) -> torch.Tensor:
    """``torch_backend.gather_rows`` with an int8 cache read and dequantized in one C pass (same
    values); ``block_size``: the step's (``AttentionMetadata.block_size``)."""
    lib, _ = load_kernel()
    if (lib is None or not kv_quant.is_int8(flat) or dtype not in _SUFFIX or not flat.is_contiguous()
            or slots.dtype != torch.int64):
        return gather_rows(flat, slots, dtype)
    slots = slots.contiguous()
    _, rows, hkv, d = flat.shape
    _check_rows(rows, block_size, d, True)
    out = torch.empty(slots.shape[0], hkv, d, dtype=dtype)
    getattr(lib, f"kv_read_int8_{_SUFFIX[dtype]}")(flat.data_ptr(), slots.data_ptr(), slots.shape[0], hkv, d,
                                                    block_size, out.data_ptr())
    return out


class CpuPagedAttention(AttentionBackend):
    """The compiled kernel for CPU tensors in fp32/bf16 (caches in that dtype or int8), for decodes
    and prefill chunks of any length, over a cached prefix or not.

    ``LONG_PREFILL`` (None: no limit) sends prefill chunks of more new tokens than that to the
    reference's SDPA instead. It was 128 while torch's flash kernel was the faster one on long
    prompts; since the AVX-512 loop, the kernel is faster at every length measured (SmolLM2, 30
    layers, 2 threads, attention only, kernel vs SDPA: 8 x 256-token prompts 67 vs 248 ms in bf16,
    94 vs 243 ms in fp32; one 2,048-token prompt 463 vs 1,086 ms in bf16, 652 vs 1,064 in fp32; one
    4,096-token prompt in chunks of 2,048, 1.8 vs 4.8 s in bf16). The KV-cache-less profiling pass
    runs on the reference.
    """

    name = "cpu"
    supports_bidirectional = True  # (those sequences through the torch reference)
    LONG_PREFILL: Optional[int] = None
    needs_zeroed_cache = False  # reads only positions < seq_len, all written

    def __init__(self) -> None:
        self._reference = TorchPagedAttention()

    @classmethod
    def unsupported_reason(cls, *, device, dtype, head_dim, block_size):
        if not str(device).startswith("cpu"):
            return f"the kernel runs on CPU tensors only (device is {device})"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not float32 or bfloat16"
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM}"
        _, err = load_kernel()
        return None if err is None else f"the kernel could not be built or loaded ({err})"

    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None, sinks=None,
                attention_chunk=None):
        if kv_cache is None or meta.block_tables is None:
            return self._reference.forward(q, k, v, kv_cache, meta, scale, sliding_window=sliding_window,
                                           logits_soft_cap=logits_soft_cap, sinks=sinks,
                                           attention_chunk=attention_chunk)
        write_kv_c(k, v, kv_cache, meta.slot_mapping, meta.block_size)
        long_prefill = self.LONG_PREFILL
        out = paged_attention(torch.empty_like(q), q.contiguous(), kv_cache, meta, scale, sliding_window,
                              logits_soft_cap, max_query_len=long_prefill or 0,
                              sinks=None if sinks is None else sinks.float().contiguous(),
                              attention_chunk=attention_chunk)
        if long_prefill is None and not meta.has_bidirectional:
            return out
        flat_k, flat_v = flat_cache(kv_cache, 0), flat_cache(kv_cache, -1)
        gather = functools.partial(gather_kv, block_size=meta.block_size)
        for i, p in enumerate(meta.prefills):
            if p.bidirectional or (long_prefill is not None and p.query_end - p.query_start > long_prefill):
                out[p.query_start:p.query_end] = self._reference.prefill(
                    q, k, v, flat_k, flat_v, meta, meta.num_decode_tokens + i, p, scale, sliding_window,
                    logits_soft_cap, gather=gather, sinks=sinks, chunk=attention_chunk)
        return out
