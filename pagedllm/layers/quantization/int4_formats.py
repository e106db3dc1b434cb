"""int4 Hugging Face checkpoints: GPTQ, AWQ (GEMM) and compressed-tensors pack-quantized, read from
config.json's ``quantization_config`` and the tensors of each quantized linear layer into
``q4_repack.Int4Weight`` (codes, scales, zeros, g_idx), then repacked into ggml Q4 blocks for the
GGUF kernels or dequantized to float (``int4_weights``).

The layouts (names as vLLM's ``gptq.py``, ``awq.py`` and ``compressed_tensors`` read them; W is
[N out, K in]; "nibble i" is bits 4i..4i+3 of an int32):

- GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` int32 [K / 8, N], nibble i of
  row r = input k = 8r + i; ``qzeros`` int32 [G, N / 8], nibble i of column c = output n = 8c + i;
  ``scales`` [G, N]; ``g_idx`` int32 [K] (the group of each input column; act order (``desc_act``)
  makes it a permutation of groups). W[n, k] = scales[g, n] * (q - z) with g = g_idx[k], where the
  ``checkpoint_format`` "gptq" (v1, the default) stores z - 1 and "gptq_v2" z. Symmetric
  checkpoints have z = 8 everywhere.
- AWQ GEMM (AutoAWQ, ``quant_method: awq``, ``version: gemm``): ``qweight`` int32 [K, N / 8] and
  ``qzeros`` int32 [G, N / 8] packed along the outputs in AutoAWQ's interleaved order: nibble i of
  column c holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; ``scales`` [G, N]; g = k // group_size;
  W = scales * (q - z). (zero_point: true only; GEMV and the other kernels' layouts are refused.)
- compressed-tensors ``pack-quantized`` (llm-compressor): ``weight_packed`` int32 [N, K / 8], nibble
  i of column c = input 8c + i, a signed code plus 8; ``weight_scale`` [N, G]; ``weight_shape`` [2]
  = (N, K); asymmetric: ``weight_zero_point`` int32 [N / 8, G] packed along the outputs the same
  way (older versions: int8 [N, G], signed); ``weight_g_idx`` [K] with actorder "group".
  W = scale * (q_signed - zp_signed) = scale * (q - (zp + 8)) in the unsigned codes.

Errors: ``ValueError`` naming the setting (bits other than 4, another packing) or the tensor (a
shape or dtype that does not fit the others, a layer missing a part).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from pagedllm.layers.linear import load_full
from pagedllm.layers.quantization.q4_repack import Int4Weight, to_blocks

INT4_METHODS = ("gptq", "awq", "compressed-tensors")
_AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + j sits in nibble _AWQ_REVERSE[j] (order [0,2,4,6,1,3,5,7])
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Int4Format:
    """What ``quantization_config`` says: method, group size (-1: one group a row; compressed-tensors:
    read from each layer's scales), symmetric, act order, and the suffixes of a layer's tensors
    (required, then optional)."""

    method: str
    group_size: int
    sym: bool
    desc_act: bool = False
    zeros_offset: int = 0  # added to stored zeros (GPTQ v1: 1)
    required: tuple = ()
    optional: tuple = ()
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else ("group from scales" if self.group_size == 0
                                                              else f"group {self.group_size}")
        return (f"{self.method} int4, {group}, {'symmetric' if self.sym else 'asymmetric'}"
                + (", act order" if self.desc_act else ""))


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"{method} checkpoint: {what}; pagedllm loads 4-bit GPTQ, AWQ (GEMM) and compressed-tensors "
                      f"pack-quantized int4 (group or channel) weights")


def int4_format(q: dict) -> Int4Format:
    """The checkpoint's ``quantization_config`` (a dict, ``quant_method`` lower-cased) -> Int4Format.

    Raises:
        ValueError: bits other than 4, an unknown GPTQ checkpoint_format or AWQ version, AWQ without
            zero points, a compressed-tensors format other than pack-quantized, quantized activations.
    """
    method = q["quant_method"]
    if method == "gptq":
        bits = int(q.get("bits", 4))
        if bits != 4:
            raise _refuse("GPTQ", f"bits {bits} is not supported")
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("GPTQ", f"checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return Int4Format("gptq", _group(q.get("group_size", 128), "GPTQ"), bool(q.get("sym", True)),
                          bool(q.get("desc_act", False)), 1 if fmt == "gptq" else 0,
                          ("qweight", "qzeros", "scales"), ("g_idx",))
    if method == "awq":
        bits = int(q.get("bits", q.get("w_bit", 4)))
        if bits != 4:
            raise _refuse("AWQ", f"bits {bits} is not supported")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("AWQ", f"version {version!r} is not supported (gemm)")
        if not q.get("zero_point", True):
            raise _refuse("AWQ", "zero_point false is not supported")
        return Int4Format("awq", _group(q.get("group_size", q.get("q_group_size", 128)), "AWQ"), False, False, 0,
                          ("qweight", "qzeros", "scales"))
    return _compressed_tensors_format(q)


def _group(g: Any, method: str) -> int:
    g = int(g)
    if g != -1 and g <= 0:
        raise _refuse(method, f"group_size {g} is not supported")
    return g


def _compressed_tensors_format(q: dict) -> Int4Format:
    groups = q.get("config_groups") or {}
    top = q.get("format")
    weights = []
    for name, grp in groups.items():
        fmt = grp.get("format") or top
        if fmt != "pack-quantized":
            raise _refuse("compressed-tensors", f"format {fmt!r} of config group {name!r} is not supported "
                                                f"(pack-quantized)")
        if grp.get("input_activations") or grp.get("output_activations"):
            raise _refuse("compressed-tensors", f"config group {name!r} quantizes activations")
        w = grp.get("weights") or {}
        bits, typ, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy", "group")
        if bits != 4 or typ != "int":
            raise _refuse("compressed-tensors", f"config group {name!r} has {bits}-bit {typ} weights")
        if strategy not in ("group", "channel"):
            raise _refuse("compressed-tensors", f"config group {name!r} has strategy {strategy!r}")
        weights.append(w)
    if not weights:
        raise _refuse("compressed-tensors", "quantization_config has no config_groups with weights")
    sym = all(w.get("symmetric", True) for w in weights)
    act = any(w.get("actorder") for w in weights)
    return Int4Format("compressed-tensors", 0, sym, act, 0, ("weight_packed", "weight_scale", "weight_shape"),
                      ("weight_zero_point", "weight_g_idx"))


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [8R, C]: nibble i of row r is row 8r + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 15).reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_cols(packed: torch.Tensor, order: Optional[tuple] = None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: column 8c + j from nibble j (or nibble order[j])."""
    shifts = torch.tensor([4 * (order[j] if order else j) for j in range(8)], dtype=torch.int32)
    return ((packed.unsqueeze(2) >> shifts) & 15).reshape(packed.shape[0], -1).to(torch.uint8)


class _Parts:
    """A layer's tensors by suffix, with checks that name the tensor."""

    def __init__(self, base: str, method: str, parts: dict[str, torch.Tensor]) -> None:
        self.base, self.method, self.parts = base, method, parts

    def name(self, suffix: str) -> str:
        return f"{self.base}.{suffix}"

    def get(self, suffix: str, dtypes: tuple, shape: Optional[tuple] = None) -> torch.Tensor:
        t = self.parts[suffix]
        if t.dtype not in dtypes:
            raise ValueError(f"{self.method} checkpoint: {self.name(suffix)} is {t.dtype}, expected "
                             f"{' or '.join(str(d) for d in dtypes)}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.method} checkpoint: {self.name(suffix)} has shape {tuple(t.shape)}, expected "
                             f"{tuple(shape)} from the layer's other tensors")
        return t

    def opt(self, suffix: str) -> Optional[torch.Tensor]:
        return self.parts.get(suffix)


def _group_index(p: _Parts, suffix: str, k: int, groups: int, group_size: int) -> torch.Tensor:
    """int64 [K]: the stored g_idx (checked: [K], values in 0..G-1) or k // group_size."""
    g = p.opt(suffix)
    if g is None:
        return torch.arange(k) // group_size
    g = p.get(suffix, (torch.int32, torch.int64), (k,)).long()
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ValueError(f"{p.method} checkpoint: {p.name(suffix)} has groups outside 0..{groups - 1}")
    return g


def _groups(p: _Parts, k: int, group_size: int, suffix: str) -> tuple[int, int]:
    """(G, group size) for K inputs and the config's group size (-1: one group)."""
    if group_size == -1:
        return 1, k
    if k % 8:
        raise ValueError(f"{p.method} checkpoint: {p.name(suffix)}: {k} input features is not a multiple of 8")
    return -(-k // group_size), group_size


def read_gptq(p: _Parts, fmt: Int4Format) -> Int4Weight:
    qweight = p.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise ValueError(f"GPTQ checkpoint: {p.name('qweight')} has shape {tuple(qweight.shape)}, expected [K / 8, N]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if n % 8:
        raise ValueError(f"GPTQ checkpoint: {p.name('qweight')}: {n} output features is not a multiple of 8")
    groups, gsize = _groups(p, k, fmt.group_size, "qweight")
    qzeros = p.get("qzeros", (torch.int32,), (groups, n // 8))
    scales = p.get("scales", _SCALE_DTYPES, (groups, n))
    g_idx = _group_index(p, "g_idx", k, groups, gsize)
    zeros = _unpack_cols(qzeros).to(torch.int16) + fmt.zeros_offset  # [G, N]
    return Int4Weight(_unpack_rows(qweight).t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), g_idx)


def read_awq(p: _Parts, fmt: Int4Format) -> Int4Weight:
    qweight = p.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise ValueError(f"AWQ checkpoint: {p.name('qweight')} has shape {tuple(qweight.shape)}, expected [K, N / 8]")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups, gsize = _groups(p, k, fmt.group_size, "qweight")
    qzeros = p.get("qzeros", (torch.int32,), (groups, n // 8))
    scales = p.get("scales", _SCALE_DTYPES, (groups, n))
    q = _unpack_cols(qweight, _AWQ_REVERSE)  # [K, N]
    zeros = _unpack_cols(qzeros, _AWQ_REVERSE).to(torch.int16)  # [G, N]
    return Int4Weight(q.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(),
                      torch.arange(k) // gsize)


def read_compressed_tensors(p: _Parts, fmt: Int4Format) -> Int4Weight:
    shape = p.get("weight_shape", (torch.int32, torch.int64), (2,))
    n, k = (int(v) for v in shape)
    packed = p.get("weight_packed", (torch.int32,), (n, -(-k // 8)))
    scale = p.get("weight_scale", _SCALE_DTYPES)
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"compressed-tensors checkpoint: {p.name('weight_scale')} has shape {tuple(scale.shape)}, "
                         f"expected [{n}, G] with G dividing {k} (weight_shape {[n, k]})")
    groups = scale.shape[1]
    zp = p.opt("weight_zero_point")
    if zp is None:
        if not fmt.sym:
            raise ValueError(f"compressed-tensors checkpoint: {p.name('weight_zero_point')} is missing "
                             f"(the config says asymmetric)")
        zeros = torch.full((n, groups), 8, dtype=torch.int16)
    elif zp.dtype == torch.int32:
        p.get("weight_zero_point", (torch.int32,), (-(-n // 8), groups))
        zeros = _unpack_rows(zp)[:n].to(torch.int16)
    else:
        zeros = p.get("weight_zero_point", (torch.int8,), (n, groups)).to(torch.int16) + 8
    g_idx = _group_index(p, "weight_g_idx", k, groups, k // groups)
    q = _unpack_cols(packed)[:, :k].contiguous()
    return Int4Weight(q, scale.contiguous(), zeros.contiguous(), g_idx)


_READERS = {"gptq": read_gptq, "awq": read_awq, "compressed-tensors": read_compressed_tensors}


def int4_weights(weights: Iterable[tuple[str, Any]], fmt: Int4Format, names: set[str], blocks: bool,
                 stats: dict, why_not: str = "the kernels are off",
                 keep: Optional[Callable[[str], bool]] = None) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each quantized layer's tensors replaced by
    ``<layer>.weight``: ``q4_repack.Int4Blocks`` when ``blocks`` and the groups fill whole blocks, else
    the float32 weight; other tensors unchanged.

    Args:
        names: every tensor name of the checkpoint (which optional parts a layer has).
        stats: filled with ("Q4_0" | "Q4_1", "blocks") or (why, "dequantized") -> layer count.
        why_not: the reason counted for each layer when ``blocks`` is False.
        keep: which ``<layer>.weight`` names may be given as blocks (the linear layers whose loaders
            take them, ``layers/quantization/gguf.py``); the others (e.g. MoE experts) are dequantized.

    Raises:
        ValueError: a layer's tensors do not fit together, or a part is missing (named).
    """
    first = fmt.required[0]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    read = _READERS[fmt.method]
    for name, w in weights:
        suffix = next((s for s in fmt.required + fmt.optional if name.endswith("." + s)), None)
        if suffix is None:
            yield name, w
            continue
        base = name[:-len(suffix) - 1]
        got = pending.setdefault(base, {})
        got[suffix] = load_full(w)
        want = [s for s in fmt.required + fmt.optional if s in fmt.required or f"{base}.{s}" in names]
        if not all(s in got for s in want):
            continue
        del pending[base]
        unpacked = read(_Parts(base, fmt.method, got), fmt)
        if not blocks:
            packed = why_not
        elif keep is not None and not keep(base + ".weight"):
            packed = "not a linear layer that takes blocks"
        else:
            packed = to_blocks(unpacked)
        if isinstance(packed, str):
            stats[(packed, "dequantized")] = stats.get((packed, "dequantized"), 0) + 1
            yield base + ".weight", unpacked.dequantize()
        else:
            stats[(packed.type_name, "blocks")] = stats.get((packed.type_name, "blocks"), 0) + 1
            yield base + ".weight", packed
    for base, got in pending.items():
        missing = [f"{base}.{s}" for s in fmt.required if s not in got]
        raise ValueError(f"{fmt.method} checkpoint: {missing[0] if missing else base + '.' + first} is missing "
                         f"(the layer has {', '.join(sorted(got))})")
