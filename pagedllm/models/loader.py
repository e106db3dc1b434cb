"""Build a model and load its weights from safetensors (one file or a sharded index) or a GGUF file,
or fill it with random weights (``load_format="dummy"``). Unreadable files and weights that do not fit
the config raise ValueError with a one-line message naming the file and the tensor."""
from __future__ import annotations

import copy
import glob
import inspect
import json
import logging
import os
import re
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.layers.attention import get_attention_backend
from pagedllm.layers.linear import loaded_shape
from pagedllm.layers.quantization import Int8Config, fp8, get_quantization_config, process_weights_after_loading
from pagedllm.layers.quantization import gguf as gguf_layers
from pagedllm.layers.quantization.int4_formats import INT4_METHODS, int4_format, int4_weights
from pagedllm.layers.quantization.smoothquant import smoothquant_alpha
from pagedllm.models.checkpoint import text_only_weights
from pagedllm.models.gguf import Q8_0Weight, is_gguf_file, iterate_gguf_weights, one_line, open_gguf
from pagedllm.models.registry import get_model_class, get_vision_tower_class
from pagedllm.models.smoothquant import smooth_for_quantization
from pagedllm.models.vision import VISION_PREFIXES
from pagedllm.platforms import ops


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files (from model.safetensors.index.json when present).

    Raises:
        FileNotFoundError: the folder has none.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))  # ("[" in a path is literal)
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir} (use load_format='dummy' for random weights)")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs; a slice reads from disk only the part a rank indexes.

    Raises:
        ValueError: a file is not valid safetensors (corrupt header, truncated data).
    """
    for path in safetensors_files(model_dir):
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {path} (corrupt or truncated?): {one_line(e)}") from None
        with f:
            for name in f.keys():
                yield name, f.get_slice(name)


logger = logging.getLogger("pagedllm")


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape the config implies, from transformers' model built on the meta device
    (no memory). Our tensor-parallel loaders narrow what they read, so a matrix larger than the config
    says would otherwise load silently. Empty when transformers cannot build the model."""
    from transformers import AutoModelForCausalLM  # lazily: transformers, ~1 s to import

    try:
        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # noqa: BLE001 - no check rather than no model
        return {}
    return {n: tuple(t.shape) for n, t in hf_model.state_dict().items()}


class _CheckedWeights:
    """Iterates ``weights``, checks each shape against ``shapes`` and remembers the last name, so a
    load error can say which tensor failed."""

    def __init__(self, weights: Iterator[tuple[str, Any]], shapes: dict[str, tuple[int, ...]]) -> None:
        self.weights, self.shapes, self.name = weights, shapes, None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, w in self.weights:
            self.name = name
            want = self.shapes.get(name)
            if want is not None and (isinstance(w, torch.Tensor) or hasattr(w, "get_shape")):
                got = tuple(loaded_shape(w))
                if got != want:
                    raise ValueError(f"shape {got} does not match the {want} the config implies")
            yield name, w


# Checkpoint names of the linear layers whose loaders take Q8_0 blocks (``layers/linear.py``).
_LINEAR_WEIGHT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def gguf_q8_0_direct(quant_config: Any) -> bool:
    """Whether a GGUF file's Q8_0 matrices go straight into the int8 layers (int8 values and block
    scales, requantized per output channel; no float copy): for ``--quantization int8`` without
    SmoothQuant. With SmoothQuant (the default) they are dequantized (exactly: fp16 x int8 fits
    float32), calibrated and smoothed, then quantized per channel: smoothing needs float weights."""
    return isinstance(quant_config, Int8Config) and smoothquant_alpha(quant_config.smooth_alpha) is None


def q8_0_for_linears_only(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Q8_0 tensors stay quantized for the linear layers' weights; the rest (embedding, router,
    LM head) are dequantized here."""
    for name, w in weights:
        if isinstance(w, Q8_0Weight) and not _LINEAR_WEIGHT.search(name):
            w = w.dequantize()
        yield name, w


# Float bytes of a file's kernel-type matrices from which they stay in blocks. Below it the float copy
# is small and the dequantized path ran faster (the fused layer runner and the float GEMMs at batch);
# above it reading float weights dominates decode. Measured on a loaded 2-core host (benchmarks/README
# section 27): Qwen2.5-1.5B Q4_K (5.2 GB dequantized) at batch 1, blocks 1.36-1.56x the tok/s at 0.34x
# the memory; SmolLM2-135M Q4_1 (0.4 GB dequantized) at batch 4, blocks 0.49x the tok/s.
GGUF_BLOCKS_MIN_FLOAT_BYTES = 1 << 30


def block_kernel_types(model_config: ModelConfig, float_elements: Callable[[frozenset], int]) -> tuple[frozenset, str]:
    """(ggml type names whose blocks a checkpoint's linear weights stay in, multiplied by the
    platform's kernels; why that is empty or what the kernels are): only without ``--quantization``,
    on one tensor-parallel rank (``layers/quantization/gguf.py``), and for a checkpoint whose
    kernel-type matrices (``float_elements(types)`` weights) would take at least
    GGUF_BLOCKS_MIN_FLOAT_BYTES in the run's dtype. GGUF files and int4 checkpoints alike."""
    if model_config.quantization not in (None, "none"):
        return frozenset(), f"--quantization {model_config.quantization}"
    if get_tp_size() != 1:
        return frozenset(), "tensor parallelism (blocks cannot be split along k)"
    types, how = ops.gguf_kernel_types()
    if types:
        size = float_elements(types) * torch.empty(0, dtype=model_config.dtype).element_size()
        if size < GGUF_BLOCKS_MIN_FLOAT_BYTES:
            return frozenset(), (f"its quantized matrices take {size / 2**20:.0f} MiB dequantized, under "
                                 f"{GGUF_BLOCKS_MIN_FLOAT_BYTES / 2**20:.0f} MiB, where the float path is the faster")
    return types, how


def gguf_block_types(model_config: ModelConfig) -> tuple[frozenset, str]:
    """``block_kernel_types`` of a GGUF file (its 2-d tensors of the kernels' types)."""
    def elements(types: frozenset) -> int:
        reader = open_gguf(model_config.model)
        return sum(int(t.n_elements) for t in reader.tensors if t.tensor_type.name in types and len(t.data.shape) == 2)

    return block_kernel_types(model_config, elements)


def _block_weights(hf_config: Any):
    """Which checkpoint names may stay in GGUF blocks: the linear layers' weights (not a MoE's
    experts, whose stacked loaders take floats), an untied LM head's, and the token embedding's
    (``VocabParallelEmbedding`` dequantizes the looked-up rows; a head tied to it multiplies its blocks)."""
    tied = getattr(hf_config, "tie_word_embeddings", False)
    return lambda name: ((_LINEAR_WEIGHT.search(name) is not None and ".experts." not in name)
                         or (name == "lm_head.weight" and not tied) or name.endswith("embed_tokens.weight"))


def describe_gguf_paths(model: torch.nn.Module, stats: dict, blocks: frozenset, how: str) -> str:
    """The start-up line: per ggml type, how many tensors stay in blocks on the kernels and how many
    were dequantized (to the model's dtype), and the weights' resident MiB."""
    types = sorted({t for t, _ in stats})
    parts = []
    for t in types:
        kept, deq = stats.get((t, "blocks"), 0), stats.get((t, "dequantized"), 0)
        if kept:
            parts.append(f"{t}: {kept} in blocks" + (f", {deq} dequantized (not a matrix of a linear layer or the "
                                                     f"embedding)" if deq else ""))
        else:
            why = ("no kernel" if t not in blocks and t not in ("F32", "F16", "BF16") else "float") if blocks else how
            parts.append(f"{t}: {deq} dequantized ({why})")
    mixed = [m for m in model.modules() if getattr(m, "gguf_types", None) and getattr(m, "gguf_bytes", None) is None]
    kept, floats = resident_bytes(model)
    return ("GGUF weights: " + "; ".join(parts) + (f" | kernels: {how}" if blocks else "") + describe_head(model)
            + (f" | {len(mixed)} layers dequantized (rows of types without a kernel)" if mixed else "")
            + f" | resident {kept / 2**20:.1f} MiB in blocks (memory-mapped file) + {floats / 2**20:.1f} MiB float")


def describe_head(model: torch.nn.Module) -> str:
    """" | LM head: ..." for the start-up line: where the LM head's and the embedding's weights are
    (blocks of which type, tied or not, or float), empty for a model without a head."""
    head = next((m for m in model.modules() if getattr(m, "is_lm_head", False)), None)
    if head is None:
        return ""
    requantized = getattr(head, "gguf_requantized", None)
    if requantized:
        return (f" | LM head: Q8_0 blocks (requantized from the tied embedding, whose lookup reads "
                f"its {requantized} table)")
    if getattr(head, "gguf_segments", None) is not None:
        where = "/".join(sorted(head.gguf_types)) + " blocks" + (" (tied: the embedding's)"
                                                                 if getattr(head, "gguf_tied", False) else "")
    else:
        where = "float"
    emb = next((m for m in model.modules() if hasattr(m, "vocab_start") and not getattr(m, "is_lm_head", False)), None)
    blocks = getattr(emb, "gguf_embedding", None)
    if emb is not None and not getattr(head, "gguf_tied", False):
        where += f"; embedding: {blocks.type_name + ' blocks' if blocks is not None else 'float'}"
    return " | LM head: " + where


def resident_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of ggml blocks the layers keep, bytes of the float parameters, each storage once)."""
    kept = sum(getattr(m, "gguf_bytes", 0) for m in model.modules())
    seen, floats = set(), 0
    for p in model.parameters():
        if p.numel() and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            floats += p.numel() * p.element_size()
    return kept, floats


def describe_int4_paths(model: torch.nn.Module, fmt: Any, stats: dict, how: str) -> str:
    """The start-up line of an int4 checkpoint: its format, how many linear layers' weights were
    repacked into Q4 blocks on the kernels and how many dequantized (and why), and the resident MiB."""
    parts = [f"{n} {t} in blocks" for (t, k), n in sorted(stats.items()) if k == "blocks"]
    parts += [f"{n} dequantized to {str(model_dtype(model)).replace('torch.', '')} ({why})"
              for (why, k), n in sorted(stats.items()) if k == "dequantized"]
    kept, floats = resident_bytes(model)
    mixed = [m for m in model.modules() if getattr(m, "gguf_types", None) and getattr(m, "gguf_bytes", None) is None]
    return (f"int4 checkpoint ({fmt.describe()}): linear weights " + ("; ".join(parts) or "none")
            + (f" | kernels: {how}" if kept else "")
            + (f" | {len(mixed)} fused layers dequantized (parts quantized in different act orders)" if mixed else "")
            + describe_head(model) + f" | resident {kept / 2**20:.1f} MiB in blocks + {floats / 2**20:.1f} MiB float")


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def checkpoint_names(model_dir: str) -> dict[str, list[int]]:
    """Every tensor name of a safetensors checkpoint -> its shape, from the files' headers."""
    shapes = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    shapes[name] = f.get_slice(name).get_shape()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {path} (corrupt or truncated?): {one_line(e)}") from None
    return shapes


def language_model_tensors(model_config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """A safetensors checkpoint's (name, tensor or lazy slice) pairs, of an image-text checkpoint its
    language model's only (under the text model's names). Raises ValueError as ``iterate_weights``."""
    raw = iterate_weights(model_config.model)
    if getattr(model_config.hf_config, "text_only_of", None):  # an image-text checkpoint's language model
        raw = text_only_weights(raw)
    return raw


def checkpoint_tensors(model_config: ModelConfig, keep: Callable[[str], bool] | None = None
                       ) -> Iterator[tuple[str, Any]]:
    """A safetensors checkpoint's (name, tensor or lazy slice) pairs as a model loads them: an image-text
    checkpoint's language model only, FP8 blocks dequantized (other float8 refused); only the names
    ``keep`` accepts where given (the others are not read). Raises ValueError as ``iterate_weights``."""
    raw = language_model_tensors(model_config)
    if keep is not None:
        raw = ((name, w) for name, w in raw if keep(name))
    checkpoint_quant = fp8.checkpoint_quantization(model_config.hf_config)
    if checkpoint_quant and checkpoint_quant["quant_method"] == "fp8":
        return fp8.dequantized(raw, checkpoint_quant)
    return fp8.refuse_float8(raw)


def load_model(model_config: ModelConfig, device: str, block_size: int) -> torch.nn.Module:
    """Instantiate the registered architecture on ``device`` in ``model_config.dtype``, with the
    attention backend ``model_config.attention_backend`` selects for it, load its weights,
    then let each layer's linear method process them (e.g. quantize them to int8)."""
    cls = get_model_class(model_config.hf_config, model_config.max_model_len)
    checkpoint_quant = fp8.checkpoint_quantization(model_config.hf_config)  # raises early for a format we cannot read
    backend = get_attention_backend(model_config.attention_backend, device=device, dtype=model_config.dtype,
                                    head_dim=model_config.head_dim, block_size=block_size)
    # A model whose layers depend on the engine's context length (e.g. Phi-3's LongRoPE) asks for it.
    extra = {"max_model_len": model_config.max_model_len} if "max_model_len" in inspect.signature(cls).parameters else {}
    hf_config = model_config.hf_config
    if model_config.runner == "pooling" and not getattr(hf_config, "tie_word_embeddings", False):
        # The pooling runner never uses the LM head: tie it, so that embedding checkpoints (saved
        # without one, as Qwen3-Embedding's) load, and a causal LM's head is not held twice.
        hf_config = copy.copy(hf_config)
        hf_config.tie_word_embeddings = True
    with torch.device(device):
        model = cls(hf_config, model_config.dtype, backend=backend, **extra)
    int4 = None  # an int4 checkpoint's format (int4_formats.Int4Format)
    if model_config.load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(model_config.seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                # Small uniform values keep activations finite through many layers.
                p.data.copy_(torch.empty(p.shape).uniform_(-0.02, 0.02, generator=gen).to(p.dtype))
    else:
        path = model_config.model
        names = None  # the checkpoint names a GGUF file's tensors are mapped onto (None: transformers' model's)
        if is_gguf_file(path):
            q8_0 = gguf_q8_0_direct(get_quantization_config(model_config.quantization))
            blocks, why_not = gguf_block_types(model_config)
            gguf_stats: dict = {}
            names = getattr(model, "checkpoint_names", lambda: None)()
            raw = iterate_gguf_weights(path, model_config.hf_config, raw_q8_0=q8_0, raw_blocks=blocks,
                                       keep=_block_weights(model_config.hf_config), stats=gguf_stats,
                                       checkpoint_names=names)
            raw = q8_0_for_linears_only(raw) if q8_0 else raw
        else:
            if checkpoint_quant and checkpoint_quant["quant_method"] in INT4_METHODS:
                int4 = int4_format(checkpoint_quant)
                shapes = checkpoint_names(path)
                packed = [s for n, s in shapes.items() if n.endswith("." + int4.required[0])]
                blocks, why_not = block_kernel_types(
                    model_config, lambda types: 8 * sum(s[0] * s[1] for s in packed) if {"Q4_0", "Q4_1"} <= types else 0)
                if not blocks:
                    why_not = why_not or "no Q4 kernels on this platform"
                int4_stats: dict = {}
                raw = int4_weights(fp8.refuse_float8(language_model_tensors(model_config)), int4, set(shapes),
                                   bool(blocks), int4_stats, why_not, keep=_block_weights(model_config.hf_config))
            else:
                raw = checkpoint_tensors(model_config)
        # A GGUF file named by the model's own names is not checked against transformers' model: its
        # shapes and its config come from the same file, and that model's imports would stay resident.
        weights = _CheckedWeights(raw, {} if names is not None else expected_shapes(model_config.hf_config))
        try:
            model.load_weights(weights)
        except ValueError as e:
            # (an FP8 pairing error names its tensor; the last one read may be another)
            named = isinstance(e, fp8.CheckpointFormatError) or "missing" in str(e)
            where = f"weight {weights.name}: " if weights.name and not named else ""
            hint = ""
            if "'lm_head.weight'" in str(e) and model_config.runner != "pooling":
                hint = " (no LM head: an embedding model? run it with --runner pooling)"
            raise ValueError(f"cannot load {path}: {where}{one_line(e)}{hint}") from None
        except SafetensorError as e:  # a lazy slice fails when its bytes are cut off
            raise ValueError(f"cannot load {path}: weight {weights.name}: {one_line(e)}") from None
    quant_config = get_quantization_config(model_config.quantization)
    # (no SmoothQuant under LoRA: the adapters' A see the unsmoothed activations; config.ModelConfig)
    smoothing = None if model_config.lora_enabled else smooth_for_quantization(model, quant_config,
                                                                                model_config.tokenizer)
    if int4 is not None and blocks and getattr(hf_config, "tie_word_embeddings", False):
        # the tied float head would be most of the bytes a decode step reads: Q8_0 blocks instead
        gguf_layers.requantize_tied_head(model)
    report = process_weights_after_loading(model, quant_config)
    if model_config.load_format != "dummy" and is_gguf_file(model_config.model) and get_tp_rank() == 0:
        logger.info("%s", describe_gguf_paths(model, gguf_stats, blocks, why_not))
    elif model_config.load_format != "dummy" and int4 is not None and get_tp_rank() == 0:
        logger.info("%s", describe_int4_paths(model, int4, int4_stats, why_not))
    report.smoothing = smoothing.describe() if smoothing else ""
    model.quantization_report = report
    if quant_config is not None and get_tp_rank() == 0:
        logger.info("quantization=%s%s: %d layers quantized; weights %.1f MiB -> %.1f MiB per rank (saved %.1f MiB)",
                    report.method, f", {report.smoothing}" if report.smoothing else "", report.num_quantized,
                    report.bytes_before / 2**20, report.bytes_after / 2**20, report.bytes_saved / 2**20)
    return model.eval()


def load_vision_tower(model_config: ModelConfig, device: str) -> Optional[torch.nn.Module]:
    """The vision tower + projector of an image-text checkpoint whose tower is registered
    (``ModelConfig.is_multimodal``), on ``device`` in the model's dtype, its weights read from the
    checkpoint's vision tensors (random under ``load_format="dummy"``); None for a text-only model.
    Raises ValueError naming the tensor that does not fit."""
    mm = model_config.multimodal_config
    if mm is None:
        return None
    cls = get_vision_tower_class(model_config.hf_config.text_only_of)
    with torch.device(device):
        tower = cls(mm, model_config.dtype)
    if model_config.load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(model_config.seed + 1)
        for name, p in tower.named_parameters():
            p.data.copy_(torch.empty(p.shape).uniform_(-0.02, 0.02, generator=gen).to(p.dtype))
    else:
        try:
            tower.load_weights((n, w) for n, w in iterate_weights(model_config.model) if n.startswith(VISION_PREFIXES))
        except ValueError as e:
            raise ValueError(f"cannot load the vision tower of {model_config.model}: {one_line(e)}") from None
    return tower.eval()
