"""GGUF checkpoints (llama.cpp's one-file format): config, tokenizer and weights from one ``.gguf``.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The file is read with the ``gguf``
library (``GGUFReader``, memory-mapped, its long metadata arrays read on demand: ``gguf_fields``;
``gguf.quants.dequantize`` for every quant type it implements).
The metadata -> config / tokenizer conversion and the GGUF -> Hugging Face tensor-name map, with the
per-architecture fix-ups (e.g. undoing the Q/K row permutation llama.cpp's converter applies to Llama),
are transformers' (``transformers.modeling_gguf_pytorch_utils``), so the weights come out under Hugging
Face checkpoint names and each model's own ``load_weights`` takes them as it takes safetensors. The
names the map starts from are the model's own (``checkpoint_names()``) where it says them, so that
transformers' model (and its modeling imports, ~200 MiB resident) is not built (``gguf_name_map``).

Errors are ``ValueError`` with a one-line message (``pagedllm serve`` prints it and exits 1).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import mmap
import os
from unittest import mock
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import torch

from pagedllm.models.registry import supported_architectures

GGUF_MAGIC = b"GGUF"
# Q8_0 block (ggml-common.h, block_q8_0): one float16 scale d, then 32 int8 values q; x = d * q.
Q8_0_BLOCK = 32


class Q8_0Weight(NamedTuple):
    """A Q8_0 tensor kept quantized: ``weight = qweight * scales`` repeated over blocks of 32 columns.

    qweight: int8 [rows, cols]; scales: float16 [rows, cols // 32] (one per block of 32 columns).
    """

    qweight: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]."""
        q = self.qweight.float().view(self.qweight.shape[0], -1, Q8_0_BLOCK)
        return (q * self.scales.float().unsqueeze(-1)).view(self.qweight.shape)


class GGUFBlocks(NamedTuple):
    """A GGUF matrix kept in its ggml blocks (for ``layers/quantization/gguf.py``): ``raw`` uint8
    [rows, cols / block * block bytes], a view of the file's memory map where the tensor is used as
    stored (a copy where the name map reorders its rows, as Llama's q/k are).

    ggml_type: the ``gguf.GGMLQuantizationType`` id; type_name: its name ("Q4_K"); cols: input features.
    """

    ggml_type: int
    type_name: str
    raw: np.ndarray
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] (``gguf.quants.dequantize``)."""
        from gguf import GGMLQuantizationType, quants  # lazily: gguf, read only for a .gguf model

        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(self.raw, GGMLQuantizationType(self.ggml_type))))


def one_line(e: BaseException) -> str:
    """``e``'s message on one line (library messages often span several), at most 400 characters."""
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= 400 else msg[:397] + "..."


def is_gguf_file(path: str) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic, or is named ``*.gguf``."""
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def find_gguf_file(path: str) -> Optional[str]:
    """The GGUF file ``path`` names: itself, or the only ``.gguf`` in a folder without config.json.

    Returns None when ``path`` is a Hugging Face folder (has config.json) or holds no ``.gguf``.
    Raises ValueError for a folder without config.json holding several ``.gguf`` files.
    """
    if os.path.isfile(path):
        return path if is_gguf_file(path) else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(found)}); pass the one to load")
    return os.path.join(path, found[0]) if found else None


def dequantizable_types() -> list[str]:
    """Names of the GGML tensor types ``gguf.quants.dequantize`` implements in this ``gguf`` version."""
    # lazily: gguf, 0.1-0.2 s to import, read only for a .gguf model
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    names = []
    for t in T:
        if t in (T.F32, T.F16):
            names.append(t.name)
            continue
        traits = quants._type_traits.get(t)
        # A traits class without its own dequantize_blocks raises NotImplementedError when used.
        if traits is not None and "dequantize_blocks" in vars(traits):
            names.append(t.name)
    return names


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` of ``path`` with every tensor checked to be dequantizable, one per file
    (and size and modification time) in this process: the config, the tokenizer and the weights
    share it.

    Raises:
        ValueError: not a GGUF file, corrupt or truncated, or a tensor type ``gguf`` cannot dequantize.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    return _open_gguf(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int):
    # The reader keeps a vocabulary's strings as offsets (gguf_fields: 293 MiB and 8-130 s less for 151,936 tokens).
    # lazily: gguf (0.1-0.2 s to import), read only for a .gguf model
    from pagedllm.models.gguf_fields import CompactGGUFReader

    name = os.path.basename(path)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = CompactGGUFReader(path)
    except Exception as e:  # noqa: BLE001 - corrupt headers fail in many ways inside the reader
        if "GGMLQuantizationType" in str(e):
            raise ValueError(f"{name}: a tensor has an unknown quant type ({one_line(e)}); the gguf library "
                             f"dequantizes {', '.join(dequantizable_types())}") from None
        raise ValueError(f"cannot read GGUF file {path} (corrupt or truncated?): {one_line(e)}") from None
    size = os.path.getsize(path)
    ok = set(dequantizable_types())
    for t in reader.tensors:
        if t.tensor_type.name not in ok:
            raise ValueError(f"{name}: tensor {t.name} has quant type {t.tensor_type.name}, which the gguf library "
                             f"cannot dequantize; supported types: {', '.join(sorted(ok))}")
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"GGUF file {path} is truncated: tensor {t.name} ends at byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size} bytes")
    return reader


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of the file (llama.cpp's name, e.g. "llama", "qwen2")."""
    field = open_gguf(path).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture in its metadata")
    return field.contents()


@contextlib.contextmanager
def _metadata_reader():
    """While transformers reads a file's metadata (config, tokenizer): ``gguf.GGUFReader(path)``
    is a copy of this process's reader of that file (open_gguf), parsed once; a 135M-parameter file
    took 3.5 s a parse, and the config and the tokenizer each parsed it again. In the copy, a gpt-oss
    file's ``rope.scaling.*`` fields have their value first: transformers reads those values as
    ``field.parts[0]``, which is the key's length (a 1-element array, which NumPy 2 will not turn
    into a float); every other reader of a field indexes ``parts`` through ``field.data``, which
    this leaves as it was. (transformers 5.x.)"""
    import gguf  # lazily: gguf, 0.1-0.2 s to import, read only for a .gguf model

    def reader(path, *args, **kwargs):
        if args or kwargs:  # a mode other than read-only: the library's own
            return real(path, *args, **kwargs)
        r = copy.copy(open_gguf(os.fspath(path)))
        r.fields = type(r.fields)(r.fields)  # the copy's own dict: the originals stay as they were
        for key, f in list(r.fields.items()):
            if ".rope.scaling." in key and f.data:
                value = f.contents()
                value = value.item() if hasattr(value, "item") else value  # a plain number, for JSON
                r.fields[key] = f._replace(parts=[value] + list(f.parts[1:]))
        return r

    real = gguf.GGUFReader
    with mock.patch.object(gguf, "GGUFReader", reader):
        yield


def _gpt_oss_config(config: Any, fields: dict) -> None:
    """What transformers' gpt-oss GGUF mapping leaves out or gets wrong, from the file's metadata:
    head_dim and the window; RoPE without scaling when the file has none (GptOssConfig's default is
    YaRN); with YaRN, llama.cpp's names for the betas and no rounding of the correction range (its
    YaRN does not round; gpt-oss's Hugging Face config says truncate: false)."""
    for key, attr in (("attention.key_length", "head_dim"), ("attention.sliding_window", "sliding_window")):
        if f"gpt-oss.{key}" in fields:
            setattr(config, attr, int(fields[f"gpt-oss.{key}"].contents()))
    rope = dict(config.rope_parameters or {})
    if "gpt-oss.rope.scaling.type" not in fields:
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 150000.0)}
        return
    for k in ("beta_fast", "beta_slow"):
        if f"yarn_{k}" in rope:
            rope[k] = rope.pop(f"yarn_{k}")
    rope.setdefault("truncate", False)
    config.rope_parameters = rope


def load_gguf_config(path: str) -> Any:
    """The transformers config built from the file's metadata (``AutoConfig.from_pretrained(gguf_file=)``),
    with ``architectures`` set to the causal-LM class of its ``model_type``.

    Raises:
        ValueError: unreadable file, or an architecture transformers cannot convert from GGUF.
    """
    # lazily: transformers, ~1 s to import
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = gguf_architecture(path)
    try:
        with _metadata_reader():
            config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/KeyError/OSError here
        raise ValueError(f"GGUF architecture {arch!r} of {path} is not supported ({one_line(e)}); "
                         f"supported architectures: {', '.join(supported_architectures())}") from None
    if config.model_type == "gpt_oss":
        _gpt_oss_config(config, open_gguf(path).fields)
    if not getattr(config, "architectures", None):
        cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        config.architectures = [cls] if cls else [f"<GGUF architecture {arch}>"]
    return config


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer (with chat template) built from the file's metadata by transformers."""
    from transformers import AutoTokenizer  # lazily: transformers, ~1 s to import

    open_gguf(path)  # a clear error for a bad file first
    try:
        with _metadata_reader():
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot build a tokenizer from the metadata of {path} ({one_line(e)}); "
                         f"pass one with --tokenizer") from None


def read_q8_0(data: np.ndarray) -> Q8_0Weight:
    """Split a Q8_0 tensor's bytes (uint8 [rows, cols / 32 * 34], as ``GGUFReader`` maps them) into
    int8 values [rows, cols] and float16 scales [rows, cols / 32], without dequantizing."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 2 + Q8_0_BLOCK)
    scales = blocks[:, :, :2].copy().view(np.float16).reshape(rows, -1)
    qweight = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1)
    return Q8_0Weight(torch.from_numpy(qweight), torch.from_numpy(scales))


def _tensor(a: np.ndarray) -> torch.Tensor:
    # Dequantized F32 tensors are read-only views of the memory map; torch wants writable memory.
    return torch.from_numpy(a if a.flags.writeable else a.copy())


class _GptOssExperts:
    """gpt-oss tensors transformers' GGUF map leaves out, back in Hugging Face's layout: llama.cpp's
    converter (``conversion/gpt_oss.py``) splits ``gate_up_proj`` [E, H, 2I] (gate and up columns
    interleaved) into ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and transposes ``down_proj``
    [E, I, H] to ``ffn_down_exps`` [E, H, I]; the sinks are ``attn_sinks``."""

    _PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_sinks")

    def __init__(self) -> None:
        self.halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (layer, kind) -> gate / up

    def takes(self, name: str) -> bool:
        return name.startswith("blk.") and name.split(".")[2] in self._PARTS

    def add(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        _, layer, part, kind = name.split(".")
        prefix = f"model.layers.{layer}."
        if part == "attn_sinks":
            yield prefix + "self_attn.sinks", t
        elif part == "ffn_down_exps":
            yield (prefix + "mlp.experts.down_proj", t.transpose(1, 2)) if kind == "weight" else \
                (prefix + "mlp.experts.down_proj_bias", t)
        else:
            got = self.halves.setdefault((layer, kind), {})
            got[part] = t
            if len(got) == 2:
                del self.halves[(layer, kind)]
                gate, up = got["ffn_gate_exps"], got["ffn_up_exps"]
                both = torch.stack([gate, up], dim=-1 if kind == "bias" else -2)  # [E, I, 2(, H)]
                if kind == "bias":
                    yield prefix + "mlp.experts.gate_up_proj_bias", both.flatten(1)
                else:
                    yield prefix + "mlp.experts.gate_up_proj", both.flatten(1, 2).transpose(1, 2)


def _drop_pages(reader: Any, t: Any) -> None:
    """Take tensor ``t``'s whole pages of the file out of this process's resident set once a copy
    of it was made (dequantized, or rows reordered as Llama's q/k): ``madvise(MADV_DONTNEED)`` on
    the read-only map. They stay in the page cache and fault back in if read again; without this
    they counted in the RSS next to their copy for the engine's life (Llama-3-8B Q4_K: the 32
    layers' q/k, 360 MiB). Partial pages at either end are left (a neighbour may be in use)."""
    mm, advice = getattr(reader.data, "_mmap", None), getattr(mmap, "MADV_DONTNEED", None)
    if mm is None or advice is None or not hasattr(mm, "madvise"):
        return
    start = -(-int(t.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (int(t.data_offset) + int(t.n_bytes)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mm.madvise(advice, start, end - start)


class _CheckpointNames:
    """Stands in for transformers' model in ``get_gguf_hf_weights_map``, which reads only its config
    and the names of its ``state_dict`` (and recurses into its children, which this has none of)."""

    def __init__(self, config: Any, names: list[str]) -> None:
        self.config, self.names = config, names

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self.names)

    def named_children(self) -> list:
        return []


def gguf_name_map(path: str, hf_config: Any, checkpoint_names: Optional[list[str]] = None) -> tuple[Any, dict]:
    """(transformers' tensor processor of the file's architecture, GGUF tensor name -> Hugging Face
    checkpoint name), by transformers' ``get_gguf_hf_weights_map``: every checkpoint name is turned
    into its GGUF name by gguf's ``TensorNameMap``. The names are ``checkpoint_names`` where given
    (those the model loads) and they name every matrix of the file, else those of transformers' model
    built on the meta device; that build imports transformers' modeling code (torch._dynamo,
    torch.distributed.tensor, sympy: ~1,800 modules, ~120 MiB of heap and ~85 MiB of libraries that
    stay resident, 3-16 s). Raises ValueError where transformers has no map for the architecture."""
    # lazily: gguf (read only for a .gguf model) and transformers (~2 s to import with its GGUF helpers)
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    processor = TENSOR_PROCESSORS.get(gguf_architecture(path), TensorProcessor)(config=hf_config.to_dict())
    # transformers rebuilds gguf's TensorNameMap (thousands of formatted names) for every submodule
    # it recurses into; one cached map per (arch, layers) turns ~400 builds into one.
    cached = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    try:
        with mock.patch.object(gguf, "get_tensor_name_map", cached):
            if checkpoint_names is not None:
                name_map = get_gguf_hf_weights_map(_CheckpointNames(hf_config, checkpoint_names), processor)
                # (a 1-d tensor no name takes, as Llama-3's rope_freqs, is not loaded by either map)
                if all(t.name in name_map for t in open_gguf(path).tensors if len(t.shape) > 1):
                    return processor, name_map
            from transformers import AutoModelForCausalLM  # lazily: transformers' modeling code, see above

            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(hf_config)
            return processor, get_gguf_hf_weights_map(hf_model, processor)
    except NotImplementedError as e:
        raise ValueError(f"{path}: {one_line(e)}") from None


def iterate_gguf_weights(path: str, hf_config: Any, raw_q8_0: bool = False, raw_blocks: frozenset = frozenset(),
                         keep: Optional[Callable[[str], bool]] = None,
                         stats: Optional[dict] = None,
                         checkpoint_names: Optional[list[str]] = None) -> Iterator[tuple[str, Any]]:
    """(Hugging Face checkpoint name, float32 tensor) pairs of the file's weights, one tensor at a time.

    Args:
        path: the .gguf file.
        hf_config: its config (``load_gguf_config``).
        raw_q8_0: yield Q8_0 matrices as ``Q8_0Weight`` (int8 values + float16 block scales) instead of
            dequantizing them, for an int8 linear method to take as they are.
        raw_blocks: names of ggml types ("Q4_K", ...) whose 2-d tensors are yielded as ``GGUFBlocks``
            (the file's bytes, not dequantized) where ``keep(hf_name)`` holds.
        keep: which Hugging Face names may stay in blocks (the linear layers' weights).
        stats: filled with (type name, "blocks" | "dequantized") -> tensor count.
        checkpoint_names: the Hugging Face names the model loads (its ``checkpoint_names()``); the
            file's tensor names are mapped onto these, else onto transformers' model's (``gguf_name_map``).

    Raises:
        ValueError: the file is unreadable, or its tensors do not map to the architecture's parameters.
    """
    # lazily: gguf, read only for a .gguf model
    from gguf.quants import dequantize

    reader = open_gguf(path)
    arch = gguf_architecture(path)
    processor, name_map = gguf_name_map(path, hf_config, checkpoint_names)
    merged: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # MoE processors merge experts here
    gpt_oss = _GptOssExperts() if arch == "gpt-oss" else None
    stats = {} if stats is None else stats
    for t in reader.tensors:
        tname = t.tensor_type.name
        if tname in raw_blocks and len(t.data.shape) == 2 and t.data.dtype == np.uint8:
            r = processor.process(weights=t.data, name=t.name)
            hf = name_map.get(r.name)
            if hf is not None and (keep is None or keep(hf)) and r.weights.shape == t.data.shape:
                stats[(tname, "blocks")] = stats.get((tname, "blocks"), 0) + 1
                if not np.may_share_memory(r.weights, t.data):  # reordered rows: a copy
                    _drop_pages(reader, t)
                yield hf, GGUFBlocks(int(t.tensor_type), tname, r.weights, int(t.shape[0]))
                continue
        stats[(tname, "dequantized")] = stats.get((tname, "dequantized"), 0) + 1
        if raw_q8_0 and t.tensor_type.name == "Q8_0" and len(t.data.shape) == 2:
            raw = read_q8_0(t.data)
            q = processor.process(weights=raw.qweight.numpy(), name=t.name)
            s = processor.process(weights=raw.scales.numpy(), name=t.name)
            if q.name in name_map:
                _drop_pages(reader, t)  # read_q8_0 copied it
                yield name_map[q.name], Q8_0Weight(_tensor(q.weights), _tensor(s.weights))
                continue
        try:
            weights = dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {one_line(e)}") from None
        if gpt_oss is not None and gpt_oss.takes(t.name):
            yield from gpt_oss.add(t.name, _tensor(np.ascontiguousarray(weights)))
            continue
        result = processor.process(weights=weights, name=t.name, tensor_key_mapping=name_map,
                                   parsed_parameters=merged)
        if result.name in name_map:
            out = _tensor(np.ascontiguousarray(result.weights))
            if not np.may_share_memory(out.numpy(), t.data):  # a copy (an F32 view is copied by _tensor)
                _drop_pages(reader, t)
            yield name_map[result.name], out
    yield from merged["tensors"].items()
    _open_gguf.cache_clear()  # the reader's parsed metadata (vocabulary, merges) is no longer needed
