"""W8A8 int8 linear layers: symmetric int8 weights per output channel, activations quantized per
token (row; optionally per group of features within the row, see ``Int8Config``) on the fly,
``int8 x int8 -> int32`` matmul (``torch._int_mm``), scales applied once after each matmul:

    x[i, :] ~ sx[i] * xq[i, :],   W[j, :] ~ sw[j] * wq[j, :],   y[i, j] = sx[i] * sw[j] * sum_k xq[i,k] wq[j,k]

(SmoothQuant, Xiao et al., 2023, per-token / per-channel "O1" setting; LLM.int8(), Dettmers et al.,
2022, vector-wise quantization). The int32 sum is exact (|sum| <= k * 127^2 < 2^31 for
k < 133,000), and every scale is per row or per column, so a row's result does not depend on the
other rows in the batch: batch composition, chunked prefill and preemption cannot change it.

Tensor parallelism: column-parallel layers (and the vocab-parallel LM head) hold whole output rows,
so their scales are those of one rank. A row-parallel layer holds a slice of each row's inputs; its
weight scales take the max over ranks at load time, its activation scales the max over ranks per
step (one all-reduce of [tokens] floats), and the ranks sum int32 partial products: TP=N gives the
same numbers as TP=1. (With activation groups, each rank scales its groups' int32 results and
the ranks sum float32 partials: TP=N equals TP=1 up to float rounding.)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from pagedllm.distributed.parallel_state import (get_tp_size, tensor_model_parallel_all_reduce,
                                                 tensor_model_parallel_all_reduce_max)
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.platforms import ops

QMAX = ops.INT8_QMAX  # symmetric: [-127, 127]; -128 unused so that negation is exact
_TINY = ops.INT8_TINY  # all-zero rows get this scale (their int8 values are then 0)
int8_mm = ops.int8_mm  # int8 [m, k] x int8 [k, n] -> exact int32 (the platform's kernel, else torch._int_mm)


def _all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Max over this stage's TP group (not the world: with pipeline parallelism it spans stages)."""
    return tensor_model_parallel_all_reduce_max(x)


def quantize_per_channel(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [n, k] (float) -> (int8 [n, k], float32 scale [n]) with ``w ~ scale[:, None] * q``.

    ``amax`` [n] overrides the rows' max |w| (row-parallel layers pass the max over ranks).
    Error per element <= scale / 2.
    """
    w = w.float()
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = amax.float().clamp_min(_TINY) / QMAX
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor, reduce_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [m, k] -> (int8 [m, k], float32 scale [m, 1]) with ``x ~ scale * q``
    (``ops.quantize_per_token``). ``reduce_amax`` takes the max over tensor-parallel ranks.
    Error per element <= scale / 2."""
    if not reduce_amax or get_tp_size() == 1:
        return ops.quantize_per_token(x)
    return ops.quantize_per_token(x, _all_reduce_max(x.abs().amax(dim=-1, keepdim=True).float()))


def int8_weight_layout(q: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] -> the [k, n] operand of ``int8_mm``: the transposed view (column-major).
    cuBLASLt needs it; on a CPU it also ran faster than a contiguous [k, n] copy (1 thread,
    k=576, n=3072: 0.55 vs 0.85 ms at m=48, 2.4 vs 7.8 ms at m=256)."""
    return q.t()


class Int8LinearMethod(LinearMethodBase):
    """Float weights are loaded as usual (``create_weights`` of the float method), then replaced
    by ``weight_q`` (int8, [k, n] layout of ``int8_weight_layout``) and ``weight_scale`` (float32 [n]);
    on a CPU with AVX512-VNNI or AVX2 ``weight_q`` then gives way to its packed panels (``pack_weight``;
    ``weight_matrix`` returns the [k, n] weight either way).

    ``act_group_size`` g > 0 (and dividing k): each token's activations get one scale per group
    of g input features instead of one per row (finer scales around outlier channels); the layer
    then runs k / g int8 matmuls of depth g and sums their scaled int32 results in float32.
    Row-parallel layers then sum float partials over ranks (groups never cross a rank's slice
    when g divides k / tp_size; otherwise the layer falls back to per-token scales).
    """

    def __init__(self, act_group_size: int = 0) -> None:
        self._float = UnquantizedLinearMethod()
        self.act_group_size = act_group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype) -> None:
        self._float.create_weights(layer, input_size, output_size, bias, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._quantize(layer)
        if self.act_group_size == 0:  # the grouped matmul reads weight_q
            pack_weight(layer)

    def _quantize(self, layer: nn.Module) -> None:
        if getattr(layer, "weight_q", None) is not None:
            return  # already int8 (set from a GGUF Q8_0 tensor by set_int8_weight, or by finish_q8_0)
        w = layer.weight.data
        amax = None
        if getattr(layer, "input_is_parallel", False) and getattr(layer, "tp_size", 1) > 1:
            amax = _all_reduce_max(w.float().abs().amax(dim=1))
        q, scale = quantize_per_channel(w, amax)
        set_int8_weight(layer, q, scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._apply(layer, x, bias, parallel_input=False, reduce_results=False)

    def apply_row_parallel(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                           reduce_results: bool) -> torch.Tensor:
        if not reduce_results and layer.tp_rank != 0:
            bias = None  # the caller sums the ranks' outputs: the bias once, from rank 0
        return self._apply(layer, x, bias, parallel_input=True, reduce_results=reduce_results)

    def _apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor], parallel_input: bool,
               reduce_results: bool) -> torch.Tensor:
        shape = x.shape
        g = self.act_group_size
        if g > 0 and shape[-1] % g == 0:
            out = _grouped_matmul(layer, x.reshape(-1, shape[-1]), g)
            if reduce_results:
                out = tensor_model_parallel_all_reduce(out)
            if bias is not None:
                out.add_(bias)
            return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        packed = getattr(layer, "weight_packed", None)  # the platform's panels (pack_weight)
        x2 = x.reshape(-1, shape[-1])
        on_panels = packed is not None and (layer.panel_max_rows is None or x2.shape[0] <= layer.panel_max_rows)
        if on_panels and not reduce_results and (not parallel_input or get_tp_size() == 1):
            # the whole linear in one call, the same bits
            out = ops.int8_panel_linear(x2, packed, layer.weight_sum, layer.weight_scale, bias)
            if out is not None:
                return out.reshape(*shape[:-1], out.shape[-1])
        xq, sx = quantize_per_token(x2, reduce_amax=parallel_input)
        if packed is not None:
            if on_panels:
                acc = ops.int8_panel_gemm(xq, packed, layer.weight_sum, layer.weight_scale.numel())
            else:  # a prefill's many rows: oneDNN's GEMM is the faster there, on the unpacked weight
                acc = int8_mm(xq, weight_matrix(layer))
        else:  # weight_sum: a few CPU rows may take the small-batch kernel
            acc = int8_mm(xq, layer.weight_q, layer.weight_sum)
        if reduce_results:
            acc = tensor_model_parallel_all_reduce(acc)  # int32 sum: exact, order-free
        out = ops.int8_epilogue(acc, sx, layer.weight_scale, bias, x.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])


def _grouped_matmul(layer: nn.Module, x: torch.Tensor, g: int) -> torch.Tensor:
    """x [m, k] float -> float32 [m, n] = sum over groups of sx[:, grp] * (xq_grp @ wq_grp) * sw."""
    m, k = x.shape
    groups = k // g
    xq, sx = quantize_per_token(x.reshape(m, groups, g))  # [m, G, g], [m, G, 1]
    xq = xq.transpose(0, 1).contiguous()  # [G, m, g]: each group's rows contiguous for _int_mm
    out: Optional[torch.Tensor] = None
    for i in range(groups):
        part = int8_mm(xq[i], layer.weight_q[i * g:(i + 1) * g]).float().mul_(sx[:, i])
        out = part if out is None else out.add_(part)
    return out.mul_(layer.weight_scale)


def set_int8_weight(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Give ``layer`` int8 weights ``q`` [n, k] with per-output-channel ``scale`` [n] (float),
    replacing its float ``weight`` (a tied weight stays alive in the module that shares it)."""
    if hasattr(layer, "weight"):
        del layer.weight
    layer.weight_q = nn.Parameter(int8_weight_layout(q), requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().to(q.device), requires_grad=False)
    layer.register_buffer("weight_sum", ops.int8_row_sums(q), persistent=False)


# Rows up to which a packed layer (not the LM head) runs on the panel GEMM; above it, a step
# unpacks the weight for torch._int_mm. SmolLM2's layers, 2 threads, 30 weights in turn, us a
# call, panel / _int_mm (+ unpack: qkv 33, o 20, gate_up 110, down 59):
#   rows      qkv 960x576   o 576x576   gate_up 3072x576   down 576x1536
#   48          97 / 91      32 / 28       114 / 187          89 / 113
#   128        266 / 251     79 / 55       589 / 652         212 / 160
#   256        586 / 514    153 / 98      1381 / 1281        395 / 297
#   2048      4858 / 4120  2863 / 1782   11910 / 10016      3741 / 2268
PANEL_MAX_ROWS = 128


def pack_weight(layer: nn.Module) -> None:
    """An int8 layer on a CPU with AVX512-VNNI or AVX2: its weight packed once for
    ``ops.int8_panel_gemm``, the packed copy replacing ``weight_q`` (the layer still takes
    n * k bytes). A decode step's rows are few, and there the panel GEMM beat ``torch._int_mm``
    (SmolLM2, 48 rows: see PANEL_MAX_ROWS); a step of more rows than ``panel_max_rows`` unpacks
    the weight (``weight_matrix``: one pass over n * k bytes, small against that many rows'
    arithmetic) for ``torch._int_mm``. The LM head always runs on the panels (its rows are the
    step's sequences; 2-2.9x ``torch._int_mm`` at 48-2,048 rows), and so does every layer on an
    AVX2 CPU without VNNI (``ops.int8_panels_only``). Layers it does not apply to (another
    device, neither VNNI nor AVX2, fewer than 64 columns a thread) are left as they are."""
    q = getattr(layer, "weight_q", None)
    if q is None or q.numel() == 0:
        return
    packed = ops.int8_pack_panels(q.t())
    if packed is None:
        return
    layer.register_buffer("weight_packed", packed, persistent=False)
    layer.weight_shape = tuple(q.t().shape)  # [n, k]
    is_head = getattr(layer, "is_lm_head", False)  # ParallelLMHead's (vocab_embedding imports this package)
    layer.panel_max_rows = None if is_head or ops.int8_panels_only() else PANEL_MAX_ROWS
    layer.weight_q = nn.Parameter(torch.empty(0, 0, dtype=torch.int8), requires_grad=False)
    layer.packed_bytes = packed.numel()


def weight_matrix(layer: nn.Module) -> torch.Tensor:
    """The layer's int8 weight as the [k, n] operand of ``int8_mm`` (``int8_weight_layout``):
    ``weight_q``, or unpacked from its panels where ``pack_weight`` packed it (a new tensor)."""
    packed = getattr(layer, "weight_packed", None)
    if packed is None:
        return layer.weight_q
    return int8_weight_layout(ops.int8_unpack_panels(packed, *layer.weight_shape))


class Int8Config(QuantizationConfig):
    """``--quantization int8``: every linear layer in W8A8 int8, the LM head too unless
    ``quantize_lm_head`` is False; layers whose name starts with a prefix in ``ignore`` stay float.

    Activation scales are per token (row), or per token and per group of ``act_group_size``
    input features (``int8-g64``; one scale per row when g does not divide k). ``smooth_alpha``:
    SmoothQuant's migration strength (``smoothquant.py``; the loader calibrates and folds the
    factors into the float weights before they are quantized; None: no smoothing). On
    SmolLM2-135M one scale per row cost +4.7 % held-out perplexity, with SmoothQuant (alpha 0.65,
    ``--quantization int8``) +1.8 %, groups of 64 +1.2 % (but k / 64 shallow int8 matmuls plus
    their float epilogues made a 1024-token prefill matmul ~8x slower; benchmarks/README.md).
    """

    name = "int8"

    def __init__(self, quantize_lm_head: bool = True, ignore: Sequence[str] = (), act_group_size: int = 0,
                 smooth_alpha: Optional[float] = None) -> None:
        self.quantize_lm_head = quantize_lm_head
        self.ignore = tuple(ignore)
        self.act_group_size = act_group_size
        self.smooth_alpha = smooth_alpha  # SmoothQuant migration strength (None: off); see smoothquant.py

    def is_layer_skipped(self, prefix: str) -> bool:
        return any(prefix == p or prefix.startswith(p + ".") for p in self.ignore)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        if self.is_layer_skipped(prefix):
            return None
        if getattr(layer, "is_lm_head", False) and not self.quantize_lm_head:  # ParallelLMHead
            return None
        return Int8LinearMethod(self.act_group_size)

    def describe(self) -> str:
        acts = f"groups of {self.act_group_size}" if self.act_group_size else "per token"
        return "int8 (W8A8, activations {}, LM head {})".format(acts, "int8" if self.quantize_lm_head else "float")
