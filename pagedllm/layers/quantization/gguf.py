"""GGUF weights kept in their ggml blocks: the linear method that multiplies them as stored.

A GGUF file's quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K where the
platform has kernels: ``ops.gguf_kernel_types``) reach a linear layer's weight loader as
``models.gguf.GGUFBlocks`` (the file's bytes, memory-mapped). ``load_blocks`` does not copy them:
it finds where the layer's own loader would put each row (its tensor-parallel slice and the fused
q/k/v or gate/up offset) by running that loader on a probe of row numbers, and records
``(first output row, ggml type id, the rows' blocks)`` segments. A fused layer may hold parts of
different types (a Q4_K_M file has Q4_K q/k and Q6_K v in some layers): one segment each.

After loading, ``finish_blocks`` gives a layer whose every row came in blocks the
``GGUFLinearMethod`` and drops its float weight (never written, so never resident); a layer with
rows from other types (dequantized into the float weight by its loader) gets its block rows
dequantized into that weight too and stays float. The method's ``apply`` is ``ops.gguf_linear``:
activations quantized to int8 per block of 32 (per 256 against the K-quants) and integer dot
products on the CPU (llama.cpp's scheme), within the bound ``platforms/cpu/gguf_gemm.py`` states of the float matmul.

int4 Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors) arrive here too, repacked into Q4_0 /
Q4_1 blocks (``q4_repack.Int4Blocks``). One quantized in activation order carries ``perm``, the input
column of each block column: the layer keeps it as ``gguf_perm`` and gathers its input's columns by it
before the GEMM. All parts of a fused layer must share it (GPTQ's q/k/v, or gate/up, see one input, so
one Hessian order); a part with another one is dequantized, and with it the whole layer.

The token embedding of a GGUF file may stay in blocks too (``keep_embedding_blocks``): its lookup
dequantizes the looked-up rows only (``embed_rows``), and where the LM head is tied to it the head
multiplies the same blocks (``tied_head_blocks``; one copy, counted once).

One tensor-parallel rank only: with more, the loader dequantizes (rows of blocks cannot be cut
along k, which row-parallel layers need).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.layers.quantization import q4_repack
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.platforms import ops


def is_blocks(loaded: Any) -> bool:
    """A GGUF tensor kept in its blocks (``models.gguf.GGUFBlocks``)."""
    return hasattr(loaded, "ggml_type") and hasattr(loaded, "raw")


def _row_map(loader: Callable, n: int, rows: int, shard_id: Any) -> torch.Tensor:
    """int64 [n]: the source row the layer's loader puts at each output row, -1 where none."""
    probe = torch.full((n, 1), -1.0)
    loader(probe, torch.arange(rows, dtype=torch.float32).view(rows, 1), shard_id)
    return probe.view(n).long()


def load_blocks(layer: nn.Module, loader: Callable, param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """A linear layer's weight loader given ``GGUFBlocks``: record where its rows go as segments in
    ``layer.gguf_segments`` (and which rows came so in ``layer.gguf_rows``); a bias, or a layer on
    several ranks, gets the dequantized tensor through ``loader``."""
    w = getattr(layer, "weight", None)
    perm = getattr(loaded, "perm", None)
    first = getattr(layer, "gguf_rows", None) is None
    if (param is not w or getattr(layer, "tp_size", 1) != 1 or loaded.cols != w.shape[1]
            or not (first or _same_perm(layer.gguf_perm, perm))):
        loader(param, loaded.dequantize(), shard_id)
        return
    n = w.shape[0]
    src = _row_map(loader, n, loaded.raw.shape[0], shard_id)
    if first:
        layer.gguf_segments, layer.gguf_rows, layer.gguf_perm = [], torch.zeros(n, dtype=torch.bool), perm
    dest, where = torch.nonzero(src >= 0).view(-1).tolist(), src.tolist()
    i = 0
    while i < len(dest):  # runs of consecutive output rows from consecutive source rows: one segment each
        j = i
        while j + 1 < len(dest) and dest[j + 1] == dest[j] + 1 and where[dest[j + 1]] == where[dest[j]] + 1:
            j += 1
        first, s0 = dest[i], where[dest[i]]
        layer.gguf_segments.append((first, loaded.ggml_type, loaded.raw[s0:s0 + j - i + 1]))
        layer.gguf_types = getattr(layer, "gguf_types", set()) | {loaded.type_name}
        i = j + 1
    layer.gguf_rows[src >= 0] = True


def _same_perm(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def finish_blocks(layer: nn.Module, keep_blocks: bool) -> bool:
    """After loading: when ``keep_blocks`` and every row came in blocks, switch the layer to
    ``GGUFLinearMethod`` (its float weight dropped) and return True; otherwise dequantize the
    block rows into the float weight and return False."""
    segments, rows = layer.__dict__.pop("gguf_segments"), layer.__dict__.pop("gguf_rows")
    perm = layer.__dict__.pop("gguf_perm", None)
    if keep_blocks and bool(rows.all()):
        layer.gguf_perm = perm
        layer.gguf_out_features = layer.weight.shape[0]
        del layer.weight
        layer.weight = None  # the layer's float weight is gone (code testing for it finds None)
        layer.gguf_segments = sorted(segments, key=lambda s: s[0])
        layer.gguf_bytes = sum(raw.nbytes for _, _, raw in segments)
        layer.packed_bytes = layer.gguf_bytes  # what the model runner's weight count adds for non-parameters
        layer.quant_method = GGUFLinearMethod()
        return True
    for first, type_id, raw in segments:
        w = dequantize_blocks(raw, type_id)
        if perm is not None:  # block column j is input column perm[j]
            w = torch.empty_like(w).index_copy_(1, perm, w)
        layer.weight.data[first:first + w.shape[0]] = w.to(layer.weight.dtype)
    return False


def dequantize_blocks(raw: Any, type_id: int) -> torch.Tensor:
    """float32 [rows, cols] of ggml blocks of ``type_id`` (Q4_0 / Q4_1 from an int4 checkpoint are
    torch tensors: ``q4_repack.dequantize_q4``; a GGUF file's types: ``gguf.quants``)."""
    if isinstance(raw, torch.Tensor):
        return q4_repack.dequantize_q4(raw, type_id)
    from gguf import GGMLQuantizationType, quants  # lazily: gguf, only for a layer with rows of mixed types
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(type_id)))


def keep_embedding_blocks(embedding: nn.Module, loaded: Any) -> None:
    """A ``VocabParallelEmbedding``'s loader given the whole table in blocks (one rank): keep them as
    ``embedding.gguf_embedding`` and release the float table (its parameter becomes empty; a tied
    LM head shares that parameter and finds the blocks on it as ``gguf_blocks``)."""
    param = embedding.weight
    embedding.gguf_embedding = loaded
    embedding.embed_dtype = param.dtype
    embedding.gguf_bytes = embedding.packed_bytes = int(loaded.raw.nbytes)
    param.gguf_blocks = loaded
    param.data = torch.empty(0, param.shape[1], dtype=param.dtype, device=param.device)


def embed_rows(blocks: Any, ids: torch.Tensor) -> torch.Tensor:
    """float32 [*ids.shape, cols]: the rows ``ids`` (int64, any shape) of a table in blocks,
    dequantized (``dequantize_blocks``: ggml's formulas), the others untouched."""
    flat = ids.reshape(-1)
    raw = blocks.raw
    rows = raw.index_select(0, flat.cpu()) if isinstance(raw, torch.Tensor) else raw[flat.cpu().numpy()]
    out = dequantize_blocks(rows, blocks.ggml_type) if len(flat) else torch.empty(0, blocks.cols)
    return out.to(ids.device).view(*ids.shape, blocks.cols)


def tied_head_blocks(head: nn.Module, keep_blocks: bool) -> bool:
    """After loading: an LM head tied to an embedding kept in blocks (its weight carries
    ``gguf_blocks``) multiplies those blocks with ``GGUFLinearMethod`` (when ``keep_blocks``: the
    head's method is the float one); otherwise the table is dequantized into the shared weight.
    Returns whether the head is on the blocks."""
    w = head.weight
    blocks = w.gguf_blocks
    if not keep_blocks:
        w.data = dequantize_blocks(blocks.raw, blocks.ggml_type).to(w.dtype)
        return False
    head.gguf_perm = None
    head.gguf_out_features = blocks.raw.shape[0]
    del head.weight
    head.weight = None
    head.gguf_segments = [(0, blocks.ggml_type, blocks.raw)]
    head.gguf_types = {blocks.type_name}
    head.gguf_bytes = head.packed_bytes = 0  # the embedding's blocks, counted there
    head.gguf_tied = True
    head.quant_method = GGUFLinearMethod()
    return True


def q8_0_blocks(w: torch.Tensor, rows_at_once: int = 4096) -> torch.Tensor:
    """uint8 [N, K / 32 * 34]: float ``w`` [N, K] (K a multiple of 32) in ggml Q8_0 blocks, by
    ggml's ``quantize_row_q8_0_ref``: d = max |x| / 127 per block of 32 (stored float16), q =
    round-half-away(x / d). Each weight moves by at most d / 2 (plus d's float16 rounding times |q|)."""
    n, k = w.shape
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    for r in range(0, n, rows_at_once):
        x = w[r:r + rows_at_once].float().view(-1, k // 32, 32)
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.trunc(x * inv + 0.5 * torch.sign(x)).to(torch.int8)
        out[r:r + rows_at_once, :, :2] = d.to(torch.float16).view(torch.uint8)
        out[r:r + rows_at_once, :, 2:] = q.view(torch.uint8)
    return out.view(n, -1)


def _holds_exactly(w: torch.Tensor, dtype: torch.dtype, rows_at_once: int = 4096) -> bool:
    """Whether every value of ``w`` is a ``dtype`` value (checked a slice of rows at a time: no full-size copy)."""
    return all(torch.equal(w[r:r + rows_at_once].to(dtype).to(w.dtype), w[r:r + rows_at_once])
               for r in range(0, w.shape[0], rows_at_once))


def requantize_tied_head(model: nn.Module) -> bool:
    """An int4 checkpoint on the kernels whose LM head is tied to its float embedding: the head
    multiplies Q8_0 blocks of the table (``q8_0_blocks``; 8.5 bits a weight, read at 1/4 of float32's
    bytes) and the lookup reads the table in the narrowest float dtype that holds it exactly (the
    checkpoint's float16 or bfloat16: the embeddings are unchanged). Returns False (nothing done) for
    a model without both on this rank, or a width not a multiple of 32."""
    head = next((m for m in model.modules() if getattr(m, "is_lm_head", False)), None)
    w = getattr(head, "weight", None)
    emb = next((m for m in model.modules() if m is not head and getattr(m, "weight", None) is w
                and hasattr(m, "vocab_start")), None) if w is not None else None
    if emb is None or getattr(head, "tp_size", 1) != 1 or w.shape[1] % 32 or not w.numel():
        return False
    raw = q8_0_blocks(w.data)
    dt = next((dt for dt in (torch.float16, torch.bfloat16) if _holds_exactly(w.data, dt)), w.dtype)
    table = w.data.to(dt)
    emb.embed_dtype = w.dtype
    emb.weight = nn.Parameter(table, requires_grad=False)
    head.gguf_perm = None
    head.gguf_out_features = raw.shape[0]
    del head.weight
    head.weight = None
    head.gguf_segments = [(0, 8, raw)]
    head.gguf_types = {"Q8_0"}
    head.gguf_bytes = head.packed_bytes = raw.numel()
    head.gguf_requantized = str(table.dtype).replace("torch.", "")
    head.quant_method = GGUFLinearMethod()
    return True


class GGUFLinearMethod(LinearMethodBase):
    """``y = x W^T (+ b)`` with W in the layer's ``gguf_segments`` (``finish_blocks`` sets it; the
    layer's float ``create_weights`` ran at construction, as for any GGUF file)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype) -> None:
        raise RuntimeError("GGUFLinearMethod is set after loading (finish_blocks), not at construction")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        perm = getattr(layer, "gguf_perm", None)
        if perm is not None:  # act-order int4: the blocks' columns are the input's in this order
            x2 = x2.index_select(1, perm)
        out = ops.gguf_linear(x2, layer.gguf_segments, layer.gguf_out_features)
        if bias is not None:
            out.add_(bias)
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
