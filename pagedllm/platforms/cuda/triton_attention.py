"""Paged attention in Triton: how does a GPU read K/V through the block table without gathering them?

Three kernels and their host wrappers (``layers/attention/triton_backend.py`` calls them; the torch
reference ``layers/attention/torch_backend.py`` is what they are tested equal to):

- ``write_kv``: the step's new K/V [N, Hkv, D] into their slots (``meta.slot_mapping``) of the paged
  cache (vLLM's ``reshape_and_cache``), copied in the model's dtype or quantized into the int8 cache of
  ``layers/attention/kv_quant.py`` with the same bytes as its torch code (a true float32 division, and
  round-half-even by the 1.5 * 2**23 trick, with fused multiply-adds off: Triton's interpreter has no
  libdevice ``rint``).
- ``_attention_kernel``: one program per (tile of BLOCK_Q query tokens of one sequence x the G query
  heads of one KV head, KV head): the M = BLOCK_Q * G rows share each K/V tile read through the block
  table (grouped-query attention without expanding K/V), with FlashAttention-2's online softmax over
  tiles of BLOCK_N keys (16 x 16 query rows x keys past head_dim 256, as MLA's 576). Queries of many
  sequences run in one launch (varlen, through a per-program table of (sequence, first query) built on
  the host from the step's metadata, kept in ``meta.derived`` for the step's other layers), causal over a cached
  prefix (chunked prefill); it takes decodes too (one query each) when ``decode_split`` is off.
- ``_decode_split_kernel`` + ``_decode_reduce_kernel``: decodes by flash-decoding: the visible context
  of each (decode, KV head) is split over ``num_splits`` programs that each keep a partial
  (max, sum, unnormalized output); the reduction combines them (and the attention sink).

Features, as ``AttentionBackend`` defines them: sliding window, logit soft-cap, attention sinks,
Llama 4's attention_chunk, fp16/bf16/fp32 and the int8 cache (dequantized in the kernel in float32, then
rounded to q's dtype, as the reference's gather), a one-plane cache (MLA's latent: the keys are the values).

Triton must be importable to import this module (the backend imports it lazily). With
``TRITON_INTERPRET=1`` set before this module is imported, the kernels run on CPU tensors through
Triton's interpreter (the tests do so).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 576  # up to MLA's latent + rope (DeepSeek: 512 + 64), in smaller tiles past 256
WIDE_HEAD_DIM = 256  # past this head_dim: tiles of 16 queries x 16 keys, 8 warps (registers)
MAX_SPLITS = 16  # flash-decoding: at most this many programs per (decode, KV head)
SPLIT_MIN_KEYS = 256  # ... each with at least about this many keys of context
INTERPRETED = bool(triton.knobs.runtime.interpret)  # what the @triton.jit decorators below saw (TRITON_INTERPRET)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation; UPCAST: the operands in float32 first (Triton 3.9's interpreter
    multiplies bfloat16 operands wrongly; their products are exact in float32, so the result is the same)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=DOT_PREC)
    return r


@triton.jit
def _quantize_row(x):
    """x [BLOCK_D] float32 (masked lanes 0) -> (values [BLOCK_D] int8, scale): kv_quant.quantize."""
    amax = tl.max(tl.abs(x), 0)
    # a true division, as the torch code (of 127 by 1 for an all-zero row, whose values are then 0)
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, tl.where(amax > 0, amax, 1.0)), 0.0)
    y = x * inv
    y = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127 < 2**22), as torch.round
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y.to(tl.int8), tl.math.div_rn(amax, 127.0)


@triton.jit
def _write_row(x_ptr, cache_ptr, blk, off, h, d, mask, valid, stride_cb, stride_cr, stride_ch,
               BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, INT8: tl.constexpr):
    x = tl.load(x_ptr + d, mask=mask, other=0.0)
    dst = cache_ptr + blk * stride_cb + off * stride_cr + h * stride_ch + d
    if INT8:
        values, scale = _quantize_row(x.to(tl.float32))
        tl.store(dst, values, mask=mask)
        # The block's scales: float32 [block_size, Hkv] in the rows after its values (kv_quant.py).
        s_ptr = cache_ptr + blk * stride_cb + BLOCK_SIZE * stride_cr + (off * NUM_KV_HEADS + h) * 4
        tl.store(s_ptr.to(tl.pointer_type(tl.float32), bitcast=True), scale, mask=valid)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cr, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, INT8: tl.constexpr, HAS_V: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    valid = slot >= 0  # a negative slot: a padding token, written nowhere
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)
    t64 = t.to(tl.int64)
    _write_row(k_ptr + t64 * stride_kt + h * stride_kh, kc_ptr, blk, off, h, d, mask, valid, stride_cb, stride_cr,
               stride_ch, BLOCK_SIZE, NUM_KV_HEADS, INT8)
    if HAS_V:
        _write_row(v_ptr + t64 * stride_vt + h * stride_vh, vc_ptr, blk, off, h, d, mask, valid, stride_cb,
                   stride_cr, stride_ch, BLOCK_SIZE, NUM_KV_HEADS, INT8)


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter has no libdevice): sign(x) (1 - e) / (1 + e), e = exp(-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_tile(cache_ptr, table_ptr, kp, kvalid, kvh, d, dmask, stride_cb, stride_cr, stride_ch,
               BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, INT8: tl.constexpr, OUT_TY: tl.constexpr):
    """K or V of key positions kp [BLOCK_N] of one sequence (its block-table row ``table_ptr``) for KV head
    kvh: [BLOCK_N, BLOCK_D] in OUT_TY (an int8 cache dequantized in float32 first); invalid keys read 0."""
    blk = tl.load(table_ptr + kp // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
    off = kp % BLOCK_SIZE
    ptrs = cache_ptr + (blk * stride_cb + off * stride_cr + kvh * stride_ch)[:, None] + d[None, :]
    x = tl.load(ptrs, mask=kvalid[:, None] & dmask[None, :], other=0)
    if INT8:
        s_ptr = cache_ptr + blk * stride_cb + BLOCK_SIZE * stride_cr + (off * NUM_KV_HEADS + kvh) * 4
        s = tl.load(s_ptr.to(tl.pointer_type(tl.float32), bitcast=True), mask=kvalid, other=0.0)
        x = x.to(tl.float32) * s[:, None]
    return x.to(OUT_TY)


@triton.jit
def _scores(q, k, kp, pos, kvalid, scale, soft_cap, window, chunk,
            SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
            CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Logits in log2 units [M, BLOCK_N] of queries q [M, D] at positions pos [M] against keys k [BLOCK_N, D]
    at kp [BLOCK_N]; -inf where a key is not visible."""
    s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale
    if SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    s = s * 1.4426950408889634  # log2(e): the softmax runs on exp2
    vis = kvalid[None, :]
    if CAUSAL:
        vis = vis & (kp[None, :] <= pos[:, None])
        if USE_WINDOW:
            vis = vis & (kp[None, :] > pos[:, None] - window)
        if USE_CHUNK:
            vis = vis & (kp[None, :] >= (pos[:, None] // chunk) * chunk)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One FlashAttention-2 step: rows' running max m_i, sum l_i, unnormalized output acc, with tile
    logits s [M, BLOCK_N] (log2 units) and values v [BLOCK_N, D]. A row with nothing visible yet keeps
    m_i = -inf and adds zeros (the max is taken as 0 there, so no inf - inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _visible_start(p, window, chunk, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr):
    """The first key position a query at position p sees."""
    lo = p * 0
    if USE_WINDOW:
        lo = tl.maximum(p - window + 1, 0)
    if USE_CHUNK:
        lo = tl.maximum(lo, (p // chunk) * chunk)
    return lo


@triton.jit
def _attention_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, sinks_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
                      prog_seq_ptr, prog_q_ptr,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cr, stride_ch, stride_bt,
                      scale, soft_cap, window, chunk,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      NUM_KV_HEADS: tl.constexpr, INT8: tl.constexpr, SOFT_CAP: tl.constexpr,
                      HAS_SINKS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
                      DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    q0 = tl.load(prog_q_ptr + pid)  # first query of this tile, counted within its sequence
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # the cached prefix: query i sits at position ctx + i

    r = tl.arange(0, BLOCK_M)  # row = (query token, head of the group)
    tok = q0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    t64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (t64 * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)

    if HAS_SINKS:  # the sink's logit starts the running max, with exp(0) = 1 in the sum and no value
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)  # past the last key the tile's last query sees
    lo = _visible_start(ctx + q0, window, chunk, USE_WINDOW, USE_CHUNK)  # the first query's first key
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        # Keys before lo are not read: behind a window their blocks may be freed (the null block, or another
        # sequence's), and the cache is not zeroed (needs_zeroed_cache = False), so they may hold NaN.
        kvalid = (kp < hi) & (kp >= lo)
        k = _load_tile(kc_ptr, table, kp, kvalid, kvh, d, dmask, stride_cb, stride_cr, stride_ch,
                       BLOCK_SIZE, NUM_KV_HEADS, INT8, q_ptr.dtype.element_ty)
        s = _scores(q, k, kp, pos, kvalid, scale, soft_cap, window, chunk, SOFT_CAP, USE_WINDOW, USE_CHUNK,
                    True, DOT_PREC, UPCAST)
        v = _load_tile(vc_ptr, table, kp, kvalid, kvh, d, dmask, stride_cb, stride_cr, stride_ch,
                       BLOCK_SIZE, NUM_KV_HEADS, INT8, q_ptr.dtype.element_ty)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC, UPCAST)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (t64 * stride_ot + head * stride_oh)[:, None] + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


@triton.jit
def _decode_split_kernel(mid_o_ptr, mid_ml_ptr, q_ptr, kc_ptr, vc_ptr, tables_ptr, seq_lens_ptr,
                         stride_qt, stride_qh, stride_cb, stride_cr, stride_ch, stride_bt,
                         scale, soft_cap, window, chunk,
                         NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         INT8: tl.constexpr, SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                         USE_CHUNK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Decode b (batch row b, query token b), KV head kvh, split sp of its visible context [lo, seq_len):
    partial (max, sum) -> mid_ml [B_d, H, NUM_SPLITS, 2], unnormalized output -> mid_o [B_d, H, NUM_SPLITS, D]."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    pos = seq_len - 1
    lo = _visible_start(pos, window, chunk, USE_WINDOW, USE_CHUNK)
    per = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + sp * per
    s_hi = tl.minimum(s_lo + per, seq_len)

    r = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + r
    row_ok = r < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + (b64 * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = tables_ptr + b64 * stride_bt
    posv = tl.full([BLOCK_H], 0, tl.int32) + pos
    for n0 in range(s_lo, s_hi, BLOCK_N):  # every key in [lo, seq_len) is visible: no causal mask
        kp = n0 + tl.arange(0, BLOCK_N)
        kvalid = kp < s_hi
        k = _load_tile(kc_ptr, table, kp, kvalid, kvh, d, dmask, stride_cb, stride_cr, stride_ch,
                       BLOCK_SIZE, NUM_KV_HEADS, INT8, q_ptr.dtype.element_ty)
        s = _scores(q, k, kp, posv, kvalid, scale, soft_cap, window, chunk, SOFT_CAP, USE_WINDOW, USE_CHUNK,
                    False, DOT_PREC, UPCAST)
        v = _load_tile(vc_ptr, table, kp, kvalid, kvh, d, dmask, stride_cb, stride_cr, stride_ch,
                       BLOCK_SIZE, NUM_KV_HEADS, INT8, q_ptr.dtype.element_ty)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC, UPCAST)

    row = (b64 * NUM_HEADS + head) * NUM_SPLITS + sp  # [BLOCK_H]
    tl.store(mid_o_ptr + (row * BLOCK_D)[:, None] + d[None, :], acc, mask=row_ok[:, None])
    tl.store(mid_ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(mid_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(out_ptr, mid_o_ptr, mid_ml_ptr, sinks_ptr, stride_ot, stride_oh,
                          NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """out[b, h] from the splits' partials: max M over them (and the sink), then
    sum_s acc_s 2^(m_s - M) / (sum_s l_s 2^(m_s - M) + 2^(sink - M))."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    smask = sp < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS + sp
    m_s = tl.load(mid_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(mid_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(mid_o_ptr + (row * BLOCK_D)[:, None] + d[None, :], mask=smask[:, None], other=0.0)
    m = tl.max(m_s, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(m_s - m)  # an empty split (m_s = -inf) weighs 0
    denom = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# The int8 write must round x * inv before rounding to an integer, as torch does: no fused multiply-add
# (Triton fuses by default; a fused x * inv + 1.5 * 2**23 would round the exact product instead).
_NO_FMA = {"enable_fp_fusion": False}


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot takes dimensions of 16 and more


def _is_int8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"triton kernels: {x.device} tensors run only through Triton's interpreter, and "
                         f"TRITON_INTERPRET=1 was not set when {__name__} was imported")


def _cache_planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K plane, V plane) [num_blocks, rows, Hkv, D]: a one-plane cache (MLA's latent) has V = K."""
    if kv_cache.shape[0] not in (1, 2) or kv_cache.dim() != 5 or not kv_cache.is_contiguous():
        raise ValueError(f"triton paged attention: the cache must be a contiguous [2 or 1, num_blocks, rows, "
                         f"Hkv, D] tensor; got {tuple(kv_cache.shape)} (contiguous {kv_cache.is_contiguous()})")
    return kv_cache[0], kv_cache[-1]


def _check_rows(kv_cache: torch.Tensor, block_size: int) -> None:
    rows, d = kv_cache.shape[2], kv_cache.shape[4]
    want = block_size + (-(-4 * block_size // d) if _is_int8(kv_cache) else 0)  # kv_quant.block_rows
    if rows != want:
        raise ValueError(f"triton paged attention: a cache block of {rows} rows does not fit block_size "
                         f"{block_size} (head_dim {d}, {'int8' if _is_int8(kv_cache) else 'model dtype'})")


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             block_size: int) -> None:
    """Write k/v [N, Hkv, D] (free token and head strides, last dim contiguous) into slots ``slot_mapping``
    [N] (int64 or int32; a negative slot is skipped) of ``kv_cache`` [2 or 1, num_blocks, rows, Hkv, D]:
    copied in the cache's dtype, or quantized into an int8 cache (rows = block_size + S, ``kv_quant.py``,
    the same bytes as ``kv_quant.write``). A one-plane cache takes k only (the keys are the values).

    Raises:
        ValueError: shapes or layouts that do not fit."""
    n, hkv, d = k.shape
    _check_device(k)
    kc, vc = _cache_planes(kv_cache)
    _check_rows(kv_cache, block_size)
    if kc.shape[-2:] != (hkv, d) or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"triton write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} (last dim contiguous) "
                         f"do not fit the cache {tuple(kv_cache.shape)}")
    if n == 0:
        return
    two = kv_cache.shape[0] == 2
    _write_kv_kernel[(n, hkv)](
        k, v, kc, vc, slot_mapping.contiguous(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=block_size, NUM_KV_HEADS=hkv,
        INT8=_is_int8(kv_cache), HAS_V=two, **_NO_FMA)


def _programs(meta, block_q: int, first_seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernel's per-program (sequence, first query) for sequences first_seq..B-1, tiles of
    block_q queries each (once per step and tiling: kept in ``meta.derived``)."""
    key = ("triton.programs", block_q, first_seq)
    if key not in meta.derived:
        seqs, firsts = [], []
        lens = [1] * meta.num_decode_tokens + [p.query_end - p.query_start for p in meta.prefills]
        for s in range(first_seq, len(lens)):
            for q0 in range(0, lens[s], block_q):
                seqs.append(s)
                firsts.append(q0)
        meta.derived[key] = (torch.tensor(seqs, dtype=torch.int32).to(device),
                             torch.tensor(firsts, dtype=torch.int32).to(device))
    return meta.derived[key]


def num_splits(max_decode_seq_len: int) -> int:
    """Flash-decoding's programs per (decode, KV head): one per SPLIT_MIN_KEYS keys, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-max_decode_seq_len // SPLIT_MIN_KEYS)))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, *,
                    sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, attention_chunk: Optional[int] = None,
                    decode_split: bool = True, splits: Optional[int] = None) -> torch.Tensor:
    """Attention of q [N, H, D] (free token/head strides, last dim contiguous) over the paged ``kv_cache``
    [2 or 1, num_blocks, rows, Hkv, D] in q's dtype or int8 for the sequences of ``meta``
    (``AttentionMetadata``: decodes first, then prefills; the step's K/V already written) -> [N, H, D] in
    q's dtype. ``decode_split``: decodes by flash-decoding (``splits`` programs per decode and KV head,
    default ``num_splits``), else through the attention kernel with the prefills. ``sinks`` [H] float.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit."""
    n, h, d = q.shape
    _check_device(q)
    kc, vc = _cache_planes(kv_cache)
    hkv = kc.shape[2]
    int8 = _is_int8(kv_cache)
    bs = meta.block_size
    _check_rows(kv_cache, bs)
    if (q.dtype not in SUPPORTED_DTYPES or (not int8 and kv_cache.dtype != q.dtype) or kc.shape[3] != d
            or h % hkv or q.stride(2) != 1 or not 1 <= d <= MAX_HEAD_DIM):
        raise ValueError(f"triton paged attention: q {tuple(q.shape)} {q.dtype} does not fit the cache "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype} (dtypes {SUPPORTED_DTYPES}, head_dim <= "
                         f"{MAX_HEAD_DIM}, H a multiple of Hkv, q's last dim contiguous)")
    if sinks is not None:
        if sinks.shape != (h,):
            raise ValueError(f"triton paged attention: sinks {tuple(sinks.shape)} for {h} query heads")
        sinks = sinks.float().contiguous()
    tables = meta.block_tables
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    group = h // hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    block_d = _block_d(d)
    common = dict(scale=float(scale), soft_cap=float(logits_soft_cap or 1.0), window=int(sliding_window or 0),
                  chunk=int(attention_chunk or 1))
    wide = d > WIDE_HEAD_DIM
    warps = 8 if wide else 4
    flags = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=16 if wide else 32, BLOCK_SIZE=bs, NUM_KV_HEADS=hkv, INT8=int8,
                 SOFT_CAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
                 USE_CHUNK=attention_chunk is not None,
                 DOT_PREC="ieee" if q.dtype == torch.float32 else None,  # fp32 stays fp32 (no TF32)
                 UPCAST=INTERPRETED and q.dtype == torch.bfloat16)
    nd = meta.num_decode_tokens
    sinks_arg = sinks if sinks is not None else q  # (unread without HAS_SINKS)
    cache_strides = (kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0))
    first = 0
    if decode_split and nd:
        ns = splits or num_splits(meta.max_decode_seq_len)
        mid_o = torch.empty(nd, h, ns, block_d, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(nd, h, ns, 2, dtype=torch.float32, device=q.device)
        _decode_split_kernel[(nd, hkv, ns)](
            mid_o, mid_ml, q, kc, vc, tables, meta.seq_lens, q.stride(0), q.stride(1), *cache_strides,
            **common, NUM_SPLITS=ns, NUM_HEADS=h, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
            **flags, num_warps=warps)
        _decode_reduce_kernel[(nd, h)](
            out, mid_o, mid_ml, sinks_arg, out.stride(0), out.stride(1), NUM_SPLITS=ns,
            SPLITS_P2=triton.next_power_of_2(ns), NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=block_d,
            HAS_SINKS=sinks is not None)
        first = nd
    if first < meta.num_seqs:
        longest = max([p.query_end - p.query_start for p in meta.prefills] + [1])
        # Rows per program: the G heads of a KV head x BLOCK_Q queries; small tiles when all are decodes.
        block_m = max(16 if longest == 1 or wide else 64, triton.next_power_of_2(group))
        block_q = block_m // group
        prog_seq, prog_q = _programs(meta, block_q, first, q.device)
        _attention_kernel[(prog_seq.shape[0], hkv)](
            out, q, kc, vc, sinks_arg, tables, meta.seq_lens, meta.query_start_loc, prog_seq, prog_q,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, **common,
            GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HAS_SINKS=sinks is not None, **flags, num_warps=warps)
    return out
