"""All decoder layers of a Llama-family or Gemma model in one C call per step on the CPU
(``platforms/cpu/layer_runner.cpp``): the kernels the Python layer loop calls (RMSNorm with the residual add,
the packed float or int8 GEMM, q/k norms, RoPE, the KV write, paged attention, SiLU * up), in the
same order on the same values, so the output is bit-identical; without the ~0.7 ms of Python a layer
costs between them (module calls, checks, one new tensor per op: 20 ms of a SmolLM2 decode step on a
2-core host). It is the CPU's counterpart of a CUDA graph: a step's layers replayed with no
interpreter in between.

It applies where every piece of a layer already runs one of those kernels: float32 or bfloat16 on a
CPU; ``LlamaDecoderLayer``/``LlamaAttention``/``LlamaMLP`` as defined (plain RoPE, with or without
Qwen3's q/k RMSNorms: Llama, Mistral, Qwen2, Qwen3; Phi-3 and Phi-4-mini, LongRoPE tables, partial
rotary and the sliding window included; SmolLM3's NoPE layers on an identity table; Granite's
residual multiplier) or Gemma 2/3's decoder layer (four norms a layer, GELU-tanh, sliding windows,
soft-capped scores, a RoPE table per layer type) or Gemma 1's (two norms, plain residual adds) or
OLMo 2's (norms after each branch, none before; q/k norms over all heads; EXAONE 4's per head, its
sliding and NoPE layers); every linear
packed for ``float_gemm_cpu`` or, quantized (``--quantization int8``), on the int8 method's packed
panels (its ``panel_linear``), or kept in a GGUF file's ggml blocks (``GGUFLinearMethod``: gguf_gemm's
``gguf_linear``, its bias added in float32 before the rounding to the model's dtype, as ``apply`` does);
the CPU paged-attention backend over a cache in the model's dtype or
int8; one tensor- and pipeline-parallel rank. Elsewhere, and in any step it does not cover (the
KV-cache-less profiling pass; more tokens than an int8 layer keeps on its panels: 128 on a VNNI
CPU), the Python loop runs. Why it does not apply is logged once per model.
Under ``--enable-lora`` it adds the adapters (``attach_lora``): after each target linear the grouped
shrink and expand of ``platforms/cpu/lora_ops.cpp`` over the step's tokens of each adapter slot, on the
LoRA hooks' slot tables read in place (their outputs equal the hooks' within float32 summation order).
``PAGEDLLM_CPU_LAYER_RUNNER=0`` turns it off (read at import); so does
``model.use_cpu_layer_runner = False`` (``pagedllm bench profile`` times the layers one by one).

For a Llama-kind model whose embedding, RoPE gather and final norm are the plain ops (the model says so:
``LlamaForCausalLM.step_tokens``), ``run_tokens`` runs the whole step from the token ids in the same C
call: the embedding and RoPE rows gathered (copies, as ``F.embedding`` and ``index_select`` make them),
the layers, then the final norm's ``add_rms_norm``. That leaves a decode step's forward 3 PyTorch ops and
two ctypes calls fewer (each 15-40 µs on a busy 2-core host, where the interpreter's and ATen's code is
cold between steps: issue 37's nano model).

What a layer is made of comes from its declaration (``platforms/layout.py``: each decoder layer's
``decoder_layout()``), the rest from the module instances (weights, eps, scale, window, soft-cap,
residual multiplier, backend): this module imports no model or layer class. No model calls it: the
model runner asks the platform (``CpuPlatform.layer_stack``) for ``layer_stack(model)`` and sets it
as ``model.layer_stack``, which the model's forward calls in place of its layer loop.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pagedllm import envs
from pagedllm.platforms.cpu import attention as attention_kernels
from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops, float_gemm as float_gemm_cpu, int8_gemm as int8_gemm_cpu
from pagedllm.platforms.cpu import gguf_gemm
from pagedllm.platforms.cpu import lora_ops as cpu_lora_ops
from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library
from pagedllm.platforms.layout import NORM_SLOTS, DecoderLayout, StepTokens

SOURCE = Path(__file__).with_name("layer_runner.cpp")
ENABLED = envs.PAGEDLLM_CPU_LAYER_RUNNER  # read once, at import
_SUFFIX = cpu_fused_ops._SUFFIX  # dtype -> the kernels' name suffix (the same in every library)
logger = logging.getLogger("pagedllm")

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("add_rms_norm", "gemm", "rotary", "rms_norm_heads", "silu_and_mul", "kv_write",
                                        "kv_write_int8", "attention", "gemma_rms_norm", "int8_linear", "lora_add",
                                        "gguf_linear")]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("elem_size", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate", "block_size", "rotary_dim")] + \
              [("scale", _f32), ("soft_cap", _f32), ("residual_scale", _f32), ("qk_norm_whole", _i64)]


class _Gguf(ctypes.Structure):  # a linear's GGUF blocks: gguf_gemm.gguf_linear's segment arguments
    _fields_ = [("nseg", _i64), ("types", _p), ("firsts", _p), ("rows", _p), ("ptrs", _p)]


class _Linear(ctypes.Structure):  # a float weight packed for the GEMM, int8 panels (scale set) or GGUF blocks (gguf set)
    _fields_ = [(name, _p) for name in ("w", "b", "wsum", "scale", "gguf")]


_LINEAR_NAMES = ("qkv", "o", "gate_up", "down")


class _LoRA(ctypes.Structure):  # one target linear's LoRA slot tables (lora/layers.py: LoRATarget)
    _fields_ = [("a", _p), ("b", _p), ("ranks", _p)]


class _LoRAStep(ctypes.Structure):  # the step's tokens grouped by slot (lora/ops.py: LoRAStep)
    _fields_ = [("order", _p), ("group_start", _p), ("group_slot", _p), ("num_groups", _i64), ("max_rank", _i64),
                ("h", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [(f"{name}_norm", _p) for name in NORM_SLOTS] + [(name, _Linear) for name in _LINEAR_NAMES] + \
               [("k_cache", _p), ("v_cache", _p), ("window", _i64), ("rope", _i64)] + \
               [(f"{name}_eps", _f32) for name in NORM_SLOTS] + [("lora", _p)]


def _linears(layer: Any) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _int8_panels(lin: Any) -> bool:
    """Whether ``lin`` is an int8 linear on packed panels (the int8 method with per-token scales:
    ``act_group_size`` 0, its ``weight_packed`` panels set by ``int8_gemm_cpu``'s packing), which on
    one rank runs ``panel_linear`` for steps up to its ``panel_max_rows``: the runner calls the same
    kernel (``build`` checks the rank; ``run`` the rows)."""
    return (getattr(getattr(lin, "quant_method", None), "act_group_size", None) == 0
            and getattr(lin, "weight_packed", None) is not None and lin.weight_scale.dtype == torch.float32
            and lin.weight_scale.is_contiguous() and lin.weight_sum.is_contiguous())


def _gguf_blocks(lin: Any) -> Optional[str]:
    """None when ``lin`` has no GGUF blocks; "" when it keeps its weight in GGUF blocks the runner
    multiplies as the loop does (``GGUFLinearMethod.apply``'s one ``gguf_gemm.linear`` call: every
    segment of a type with a kernel and whole blocks along its input, no act-order permutation, one
    rank); else why not."""
    segments = getattr(lin, "gguf_segments", None)
    if segments is None:
        return None
    if getattr(lin, "gguf_perm", None) is not None:
        return "GGUF blocks of an act-order int4 checkpoint (their input columns permuted)"
    ok, why = gguf_gemm.available()
    if not ok:
        return f"GGUF blocks without the kernels ({why})"
    k = lin.input_size
    if getattr(lin, "tp_size", 1) != 1 or any(t not in gguf_gemm.TYPES or k % gguf_gemm.TYPES[t][1]
                                              for _, t, _ in segments):
        return f"GGUF blocks of {sorted(getattr(lin, 'gguf_types', ()))} that gguf_gemm does not multiply at K={k} on one rank"
    return ""


_SCRATCH = ("h", "qkv", "q", "attn", "gate_up", "act")
# A layer's phases, in the order the runner calls them: its optional timings (bench profile) are
# seconds per phase, summed over the layers. Gemma's names where its layer differs, and one more.
PHASES = ("input_layernorm", "qkv_proj", "rotary (+ q/k norms)", "kv_write", "attention (+ q copy)", "o_proj",
          "post_attention_layernorm", "gate_up_proj", "silu_and_mul", "down_proj")
GEMMA_PHASES = PHASES[:6] + ("post_attention_layernorm + pre_feedforward_layernorm", "gate_up_proj",
                             "gelu_tanh_and_mul", "down_proj", "post_feedforward_layernorm")
# OLMo 2 / EXAONE 4: no norm before attention or the MLP (no phase 0)
POST_NORM_PHASES = (None,) + PHASES[1:6] + ("post_attention_layernorm + add", "gate_up_proj",
                                                         "silu_and_mul", "down_proj", "post_feedforward_layernorm + add")
# The layer kinds the runner covers (DecoderLayout.kind) -> (its C entry point, its phase names, the
# norm formula and the MLP activation that entry point computes: DecoderLayout.norm, .mlp)
_KINDS = {"llama": ("run_decoder_layers", PHASES, "rms", "swiglu"),
          "gemma": ("run_gemma_layers", GEMMA_PHASES, "gemma_rms", "gelu_tanh"),
          "post_norm": ("run_post_norm_layers", POST_NORM_PHASES, "rms", "swiglu")}


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("x", _p), ("residual", _p), ("x_out", _p), ("has_residual", _i64),
                ("cos_sin", _p * 2), ("slot_mapping", _p), ("block_tables", _p), ("seq_lens", _p),
                ("query_start_loc", _p), ("bt_stride", _i64), ("num_seqs", _i64)] + [(n, _p) for n in _SCRATCH] + \
               [("timings", _p), ("lora", ctypes.POINTER(_LoRAStep))] + \
               [(n, _p) for n in ("input_ids", "positions", "embed", "rope_cache", "final_norm", "final_out")] + \
               [("vocab", _i64), ("max_pos", _i64), ("final_eps", _f32), ("bad_input", _i64)] + \
               [("lm_head", _p), ("logits", _p), ("lm_head_n", _i64)]


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, BASE_FLAGS)
    for fn in (getattr(lib, entry) for entry, *_ in _KINDS.values()):
        fn.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Dims), ctypes.POINTER(_Layer), ctypes.c_int,
                       ctypes.POINTER(_Step)]
        fn.restype = None
    return lib


_LIBRARY = LazyLibrary(_build)


def _addr(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _norm(layer: Any, path: Optional[str]) -> Any:
    for part in path.split(".") if path else ():
        layer = getattr(layer, part, None)
    return layer if path else None


def _layer_norms(layer: Any, layout: DecoderLayout) -> list[tuple[str, Any]]:
    """(struct slot, norm module or None) for each of NORM_SLOTS, at the layout's attribute paths."""
    return [(slot, _norm(layer, path)) for slot, path in layout.norms]


def _backend_window(attn: Any) -> tuple[Any, int]:
    """(attn's attention backend, its sliding window; 0: none): the backend a wrapper passes its
    ``window`` to (``inner``: Phi-3's SlidingWindowBackend), else the attention's own ``sliding_window``
    (Gemma 2/3's), as ``layers/attention/backend.attention_window`` reads them."""
    backend = attn.backend
    inner = getattr(backend, "inner", None)
    if inner is not None:
        return inner, getattr(backend, "window", None) or 0
    return backend, getattr(attn, "sliding_window", None) or 0


def _attention_variant(attn: Any) -> str:
    """Why the C loop cannot run attention module ``attn`` (an attention variant it lacks, read from the
    module's attributes: LlamaAttention's), or ""."""
    if getattr(attn, "qk_norm_after_rope", False):
        return "q/k norms after RoPE (HunYuan)"
    if getattr(attn, "sinks", None) is not None:
        return "attention sinks (gpt-oss)"
    if getattr(attn, "query_scale", None) is not None:
        return "Llama 4's query scaling (Ministral 3 with max_model_len past original_max_position_embeddings)"
    return ""


def _check_layers(model: Any) -> tuple[Optional[DecoderLayout], list, str]:
    """(the layers' one DecoderLayout, their distinct RoPE tables, "") when every layer declares the
    same layout (``decoder_layout()``: the plain decoder layer of its family) of a kind the runner
    covers and attends as it does, else (None, [], why not)."""
    ropes: list = []
    layout: Optional[DecoderLayout] = None
    tables = getattr(model, "rotary_embs", None)  # the RoPE tables a step gathers (the layers index them)
    tables = tables() if tables is not None else []
    for layer in model.layers:
        attn = layer.self_attn
        why = _attention_variant(attn)
        if why:
            return None, [], why
        declare = getattr(layer, "decoder_layout", None)
        if declare is None:
            return None, [], f"{type(layer).__name__} declares no decoder layout"
        mine, why = declare()
        if why:
            return None, [], why
        if layout is not None and mine != layout:
            return None, [], "layers of different layouts"
        layout = mine
        if layout.kind not in _KINDS:
            return None, [], f"a {layout.kind} decoder layer"
        _, _, norm, act = _KINDS[layout.kind]
        if layout.mlp != act:
            return None, [], ("a Gemma MLP whose activation is not GELU-tanh" if layout.kind == "gemma"
                              else f"a {layout.mlp} MLP, not SwiGLU")
        if layout.norm != norm:
            return None, [], f"{layout.norm} norms in a {layout.kind} decoder layer"
        rot = attn.rotary_emb
        if all(rot is not r for r in tables):
            return None, [], "a layer's RoPE is not one of the model's step tables"
        if all(rot is not r for r in ropes):
            ropes.append(rot)
    if len(ropes) > 2:
        return None, [], "more than 2 RoPE tables"
    if len({r.rotary_dim for r in ropes}) > 1:
        return None, [], "RoPE tables of different widths"
    return layout, ropes, ""


def _is_cpu_paged_attention(backend: Any) -> bool:
    """Whether ``backend`` is the CPU paged-attention backend (``name`` "cpu": its kernels, the runner's)
    for every prefill length (``LONG_PREFILL`` None: none sent to SDPA)."""
    return getattr(backend, "name", None) == "cpu" and getattr(backend, "LONG_PREFILL", None) is None


class CpuLayerRunner:
    """The runner for one model; ``build`` says whether it applies. ``run`` does one step."""

    def __init__(self, model: Any, dtype: torch.dtype, lib: ctypes.CDLL, kernels: dict, dims: _Dims,
                 ropes: list, layout: DecoderLayout) -> None:
        self.model, self.dtype, self.lib = model, dtype, lib
        self.kernel_sets, self.dims = kernels, dims  # cache dtype ("auto" | "int8") -> _Kernels
        self.kernels: Optional[_Kernels] = None
        self.layout = layout  # what every layer is made of (platforms/layout.py)
        self.ropes, self.gemma = ropes, layout.kind == "gemma"  # the RoPE tables the layers index; Gemma 1/2/3
        entry, self.phases, _, _ = _KINDS[layout.kind]
        self.run_layers = getattr(lib, entry)
        self.steps_run = 0  # steps it ran (the rest went to the Python loop)
        self.token_steps_run = 0  # of those, steps run from the token ids (run_tokens)
        self.logit_steps_run = 0  # of those, steps that returned the logits (the LM head in the call too)
        self.max_rows: Optional[int] = None  # steps of more tokens go to the loop (int8 layers' panel_max_rows)
        # None, or seconds per phase (GEMMA_PHASES' length) summed over layers and steps (set by timing_on)
        self.timings: Optional[ctypes.Array] = None
        self.layers: Optional[ctypes.Array] = None
        self.cache_key: tuple = ()  # (the caches' pointers, the block size) self.layers was built for
        self.held: list = []  # the tensors self.layers points into
        # --enable-lora: the LoRA runtime whose adapters each step adds (attach_lora), the layers' target
        # tables (4 a layer: qkv, o, gate_up, down), or why the runner leaves steps with adapter tokens
        # to the Python loop; the steps with adapter tokens it ran
        self.lora: Optional[Any] = None
        self.lora_tables: Optional[ctypes.Array] = None
        self.lora_off: str = ""
        self.lora_held: list = []  # the tensors lora_tables points into
        self.lora_steps_run = 0
        # whether the model's final norm (platforms/ops.py: fused_add_rms_norm) is this kernel (run_tokens)
        self.final_norm_same: Optional[bool] = None
        # run_tokens: the model's tables (embedding, RoPE, final norm) and LM head last checked, and the
        # step struct over the scratch kept between steps (grown as needed)
        self.token_tables: tuple = ()
        self.token_head: Optional[torch.Tensor] = None
        # (rows it fits, (its _Step, x, cos_sin, final norm's output), the tensors it holds) or None
        self.token_step: Optional[tuple] = None
        attn = model.layers[0].self_attn
        self.q_size = attn.num_heads * attn.head_dim
        self.kv_size = attn.num_kv_heads * attn.head_dim

    @classmethod
    def build(cls, model: Any) -> tuple[Optional["CpuLayerRunner"], str]:
        """(runner, "") for a model it covers, else (None, why not)."""
        if not ENABLED:
            return None, "PAGEDLLM_CPU_LAYER_RUNNER=0"
        layers = list(model.layers)
        if not layers or getattr(model, "start_layer", 0) != 0 or getattr(model, "end_layer", len(layers)) != len(layers):
            return None, "pipeline parallelism"
        layout, ropes, why = _check_layers(model)
        if why:
            return None, why
        first = layers[0]
        dtype = first.post_attention_layernorm.weight.dtype
        hidden = first.post_attention_layernorm.weight.shape[0]
        # OLMo 2's q/k norms span all heads: one row of num_heads * head_dim a token
        qk_whole = layout.qk_norm == "whole"
        if dtype not in _SUFFIX:
            return None, f"dtype {dtype}"
        soft_cap = getattr(first.self_attn, "logits_soft_cap", None) or 0.0
        residual_scale = getattr(first, "residual_multiplier", 1.0)  # Granite's
        # any int8, GGUF or float linears; the most rows a step may have (the int8 ones' panel_max_rows)
        int8, gguf, float_linears, max_rows = False, False, False, None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            backend = _backend_window(attn)[0]
            if not _is_cpu_paged_attention(backend):
                return None, f"attention backend {type(backend).__name__}"
            if (attn.scale != first.self_attn.scale or (getattr(attn, "logits_soft_cap", None) or 0.0) != soft_cap
                    or getattr(layer, "residual_multiplier", 1.0) != residual_scale):
                return None, "attention scales, soft-caps or residual multipliers that differ between layers"
            for lin in _linears(layer):
                why = _gguf_blocks(lin)
                if why:
                    return None, why
                if why is not None:  # "": GGUF blocks on gguf_gemm's kernels
                    gguf = True
                    continue
                w, panels = getattr(lin, "gemm_weight", None), _int8_panels(lin)
                if getattr(lin, "tp_size", 1) != 1 or not (w is not None and w.dtype == dtype or panels):
                    cols = getattr(lin, "output_size", None)
                    if w is None and not panels and cols is not None and not float_gemm_cpu.fills_threads(cols):
                        return None, (f"a {type(lin).__name__} of {cols} output columns is too narrow to "
                                      f"pack for float_gemm_cpu on {torch.get_num_threads()} threads (64 columns a "
                                      f"thread); it stays on oneDNN")
                    return None, (f"a {type(lin).__name__} is neither a {dtype} linear packed for float_gemm_cpu "
                                  f"nor an int8 one on packed panels, on one rank")
                if panels and lin.panel_max_rows is not None:
                    max_rows = min(max_rows or lin.panel_max_rows, lin.panel_max_rows)
                int8, float_linears = int8 or panels, float_linears or not panels
            params = [n.weight for _, n in _layer_norms(layer, layout) if n is not None]
            params += [lin.bias for lin in _linears(layer) if lin.bias is not None]
            if any(p.dtype != dtype or not p.is_contiguous() or p.device.type != "cpu" for p in params):
                return None, "RMSNorm weights or biases not contiguous in the model's dtype"
        head_dim = first.self_attn.head_dim
        if (hidden > cpu_fused_ops.MAX_HIDDEN or head_dim % 2 or head_dim > cpu_fused_ops.MAX_HEAD_DIM
                or (qk_whole and first.self_attn.num_heads * head_dim > cpu_fused_ops.MAX_HIDDEN)):
            return None, "hidden size or head_dim outside the fused kernels' range"
        sfx = _SUFFIX[dtype]
        libs = {}
        for name, lazy in (("runner", _LIBRARY), ("fused", cpu_fused_ops._LIBRARY), ("gemm", float_gemm_cpu._LIBRARY),
                           ("attention", attention_kernels._LIBRARY)) + ((("int8", int8_gemm_cpu._LIBRARY),) if int8 else ()) \
                + ((("gguf", gguf_gemm._LIBRARY),) if gguf else ()):
            lib, err = lazy.get()
            if lib is None:
                return None, f"the {name} library is unavailable ({err})"
            libs[name] = lib
        if (float_linears and float_gemm_cpu._GEMM.get(dtype) is None) or not cpu_fused_ops.ENABLED:
            return None, f"no {dtype} GEMM or fused ops"
        fused = {name: _addr(libs["fused"], f"{name}_{sfx}") for name in (
            "add_rms_norm", "rotary", "rms_norm_heads", "gemma_rms_norm_heads", "silu_and_mul", "gelu_tanh_and_mul",
            "gemma_rms_norm")}
        common = dict(add_rms_norm=fused["add_rms_norm"],
                      gemm=_addr(libs["gemm"], f"float_gemm_{sfx}") if float_linears else None,
                      rotary=fused["rotary"], gemma_rms_norm=fused["gemma_rms_norm"],
                      rms_norm_heads=fused["gemma_rms_norm_heads" if layout.norm == "gemma_rms" else "rms_norm_heads"],
                      silu_and_mul=fused["gelu_tanh_and_mul" if layout.mlp == "gelu_tanh" else "silu_and_mul"],
                      int8_linear=_addr(libs["int8"], f"int8_panel_linear_{sfx}") if int8 else None,
                      gguf_linear=_addr(libs["gguf"], "gguf_linear") if gguf else None)
        kernels = {"auto": _Kernels(**common, kv_write=_addr(libs["attention"], f"kv_write_{sfx}"), kv_write_int8=None,
                                    attention=_addr(libs["attention"], f"paged_attention_{sfx}")),
                   "int8": _Kernels(**common, kv_write=None, kv_write_int8=_addr(libs["attention"], f"kv_write_int8_{sfx}"),
                                    attention=_addr(libs["attention"], f"paged_attention_{sfx}_i8"))}
        attn = first.self_attn
        dims = _Dims(elem_size=torch.empty(0, dtype=dtype).element_size(),
                     hidden=hidden, num_heads=attn.num_heads,
                     num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                     intermediate=first.mlp.down_proj.input_size, block_size=0, rotary_dim=ropes[0].rotary_dim,
                     scale=attn.scale, soft_cap=soft_cap, residual_scale=residual_scale, qk_norm_whole=int(qk_whole))
        runner = cls(model, dtype, libs["runner"], kernels, dims, ropes, layout)
        runner.max_rows = max_rows
        return runner, ""

    def attach_lora(self, lora: Any) -> str:
        """Add the adapters of ``lora`` (a ``pagedllm.lora.runtime.LoRARuntime``: its targets' slot tables,
        read in place each step, and ``ctx.step``, the step's grouping) to the steps this runner runs.
        Returns "" where it can, else why not (then steps with adapter tokens go to the Python loop,
        whose forward hooks add them)."""
        self.lora, self.lora_tables, self.layers = lora, None, None  # the layer structs point at the tables
        addr = cpu_lora_ops.kernel_address(self.dtype)
        if addr is None:
            self.lora_off = f"no CPU LoRA kernel ({cpu_lora_ops._LIBRARY.error or self.dtype})"
            return self.lora_off
        by_module = {id(t.module): t for t in lora.targets}
        d = self.dims
        bounds = {"qkv": [0, self.q_size, self.q_size + self.kv_size, self.q_size + 2 * self.kv_size],
                  "o": [0, d.hidden], "gate_up": [0, d.intermediate, 2 * d.intermediate], "down": [0, d.hidden]}
        tables, held = (_LoRA * (4 * len(self.model.layers)))(), []
        for i, layer in enumerate(self.model.layers):
            for j, (name, lin) in enumerate(zip(_LINEAR_NAMES, _linears(layer))):
                t = by_module.get(id(lin))
                if t is None:
                    continue  # a linear no adapter may target: null tables
                slice_bounds = [t.out_slices[0][0]] + [off + size for off, size in t.out_slices]
                if (t.reduce is not None or t.a.dtype != self.dtype or t.b.dtype != self.dtype or not t.a.is_cpu
                        or not t.a.is_contiguous() or not t.b.is_contiguous() or slice_bounds != bounds[name]
                        or t.max_rank != lora.max_rank):
                    self.lora_off = f"the LoRA slots of {t.name} are not laid out as the runner reads them"
                    return self.lora_off
                tables[4 * i + j] = _LoRA(t.a.data_ptr(), t.b.data_ptr(), t.ranks_t.data_ptr())
                held += [t.a, t.b, t.ranks_t]
        for kernels in self.kernel_sets.values():
            kernels.lora_add = addr
        self.lora_tables, self.lora_held, self.lora_off = tables, held, ""
        return ""

    def _lora_step(self) -> tuple[Optional[_LoRAStep], list]:
        """(the step's grouping for the C loop, the tensors it points into) from ``self.lora.ctx.step``."""
        step = self.lora.ctx.step
        order, starts, slots = cpu_lora_ops.group_tensors(step.order, step.bounds, step.slots)
        h = torch.empty(order.numel(), 3 * self.lora.max_rank, dtype=torch.float32)
        ls = _LoRAStep(order=order.data_ptr(), group_start=starts.data_ptr(), group_slot=slots.data_ptr(),
                       num_groups=len(step.slots), max_rank=self.lora.max_rank, h=h.data_ptr())
        return ls, [order, starts, slots, h]

    def _layer_structs(self, kv_caches: list, block_size: int) -> Optional[ctypes.Array]:
        """The layers' pointers for these KV caches of ``block_size``-token blocks (the step's
        ``meta.block_size``; rebuilt when the caches or the block size change), or None when a cache
        is not the layout the kernels take."""
        key = (tuple(c.data_ptr() if c is not None else 0 for c in kv_caches), block_size)
        if key == self.cache_key and self.layers is not None:
            return self.layers
        structs = (_Layer * len(self.model.layers))()
        # The tensors the structs point into, held here: a weight replaced on the model later must
        # not leave a pointer to freed memory (the caches' pointers are checked every step).
        held = list(kv_caches)
        cache_dtype = kv_caches[0].dtype if kv_caches and kv_caches[0] is not None else None
        if cache_dtype not in (self.dtype, torch.int8) or block_size < 1:
            return None
        d = self.dims
        # A block's token rows: an int8 cache's float32 scales follow its rows, ceil(4 * block_size /
        # head_dim) rows more (kv_quant.scale_rows; the kernels find them from block_size and head_dim).
        rows = block_size + (-(-4 * block_size // d.head_dim) if cache_dtype == torch.int8 else 0)
        for index, (s, layer, cache) in enumerate(zip(structs, self.model.layers, kv_caches)):
            if (cache is None or cache.dtype != cache_dtype or not cache.is_contiguous() or cache.dim() != 5
                    or cache.shape[0] != 2 or cache.shape[2] != rows or cache.shape[-2:] != (d.num_kv_heads, d.head_dim)):
                return None
            attn = layer.self_attn
            half = cache.stride(0) * cache.element_size()
            for name, norm in _layer_norms(layer, self.layout):
                if norm is not None:  # (null: none)
                    held.append(norm.weight)
                    setattr(s, f"{name}_norm", _ptr(norm.weight))
                    setattr(s, f"{name}_eps", norm.eps)
            s.window = _backend_window(attn)[1]
            s.rope = next(i for i, r in enumerate(self.ropes) if r is attn.rotary_emb)
            for name, lin in zip(_LINEAR_NAMES, _linears(layer)):
                blocks = None
                if getattr(lin, "gguf_segments", None) is not None:
                    tensors = (None, lin.bias, None, None)
                    # gguf_gemm.linear's own segment arrays for this layer (cached there by the segment list)
                    count, *arrays = gguf_gemm._pack(lin.gguf_segments, lin.input_size, lin.gguf_out_features)
                    blocks = _Gguf(count, *(ctypes.addressof(a) for a in arrays))
                    held += [lin.gguf_segments, blocks, *arrays]
                elif _int8_panels(lin):
                    tensors = (lin.weight_packed, lin.bias, lin.weight_sum, lin.weight_scale)
                else:
                    tensors = (lin.gemm_weight, lin.bias, None, None)
                held += tensors
                setattr(s, name, _Linear(*(_ptr(t) for t in tensors),
                                         ctypes.addressof(blocks) if blocks is not None else None))
            s.k_cache, s.v_cache = cache.data_ptr(), cache.data_ptr() + half
            if self.lora_tables is not None:
                s.lora = ctypes.addressof(self.lora_tables) + 4 * index * ctypes.sizeof(_LoRA)
        self.layers, self.cache_key, self.held = structs, key, held
        self.kernels = self.kernel_sets["int8" if cache_dtype == torch.int8 else "auto"]
        d.block_size = block_size
        return structs

    def run_tokens(self, tokens: StepTokens, kv_caches: list, meta: Any) -> Optional[torch.Tensor]:
        """A whole step of a Llama-kind model from its tokens: the embedding rows, the RoPE rows, all
        layers and the final norm in the one C call -> the final norm's output [N, hidden] (a new
        tensor, the model's ``forward`` output), or with ``tokens.lm_head`` the logits [N, tokens.vocab]
        (a new tensor: the LM head's GEMM in the same call, the one ``float_gemm.linear`` makes),
        bit-identical to those ops run one by one; None, nothing touched, where ``run`` would not cover
        the step, the tensors are not as below, or an id or position is out of range (the caller's own
        ops then run, and raise). Its scratch (the inputs gathered, the layers' buffers) and the step
        struct pointing into it are kept between steps (a decode step's Python is per-step cost: issue
        37's nano model); nothing but the output is returned from them."""
        ids, pos, head = tokens.input_ids, tokens.positions, tokens.lm_head
        if (not self._token_tables_ok(tokens) or ids.dtype != torch.int64 or pos.dtype != torch.int64 or ids.dim() != 1
                or pos.shape != ids.shape or not ids.is_contiguous() or not pos.is_contiguous() or not ids.is_cpu
                or not pos.is_cpu):
            return None
        n = ids.shape[0]
        step, x, cos_sin, final = self._token_step(n, tokens)
        out = final[:n] if head is not None else torch.empty(n, self.dims.hidden, dtype=self.dtype)
        logits = None if head is None else torch.empty(n, tokens.lm_head_out, dtype=self.dtype)
        step.input_ids, step.positions, step.final_out = ids.data_ptr(), pos.data_ptr(), out.data_ptr()
        if head is not None:
            step.lm_head, step.logits, step.lm_head_n = head.data_ptr(), logits.data_ptr(), tokens.lm_head_out
        else:
            step.logits = None
        if self._run(x[:n], None, cos_sin[:n], kv_caches, meta, step) is None:
            return None
        self.token_steps_run += 1
        if logits is None:
            return out
        self.logit_steps_run += 1
        return logits if tokens.vocab == tokens.lm_head_out else logits[:, :tokens.vocab]

    def _token_tables_ok(self, tokens: StepTokens) -> bool:
        """Whether run_tokens can take ``tokens``' tables (embedding, RoPE, final norm, LM head: the
        model's own, the same tensors every step, so checked once while they stay the same)."""
        tables, head = (tokens.embed, tokens.rope_cache, tokens.norm_weight), tokens.lm_head
        known = len(self.token_tables) == 3 and all(a is b for a, b in zip(tables, self.token_tables))
        if known and (head is None or head is self.token_head):
            return True
        embed, cache, norm_w = tables
        d = self.dims
        if self.final_norm_same is None:
            # The model's final norm (platforms/ops.py) runs this kernel only where the process's platform
            # is the CPU's, i.e. where torch sees no GPU (platforms/__init__.py decides so; not imported
            # here: it imports this module). A CPU device on a GPU host takes the CUDA wing's ops.
            self.final_norm_same = not torch.cuda.is_available()
        if (not self.final_norm_same or self.layout.kind != "llama" or len(self.ropes) != 1
                or embed.dtype != self.dtype or cache.dtype != self.dtype
                or norm_w.dtype != self.dtype or not embed.is_contiguous() or not cache.is_contiguous()
                or not norm_w.is_contiguous() or embed.dim() != 2 or embed.shape[1] != d.hidden
                or norm_w.shape != (d.hidden,) or cache.dim() != 3 or cache.shape[1:] != (2, d.rotary_dim)):
            return False
        # the LM head: the float GEMM's packed float32 weight (compute_logits' .float() is then none)
        if head is not None and (self.dtype != torch.float32 or head.dtype != self.dtype or not head.is_contiguous()
                                 or self.kernel_sets["auto"].gemm is None or not 0 < tokens.vocab <= tokens.lm_head_out
                                 or head.numel() != float_gemm_cpu.packed_elems(tokens.lm_head_out, d.hidden, self.dtype)):
            return False
        if not known:
            self.token_tables, self.token_step = tables, None  # (the step struct points at the tables)
        if head is not None:
            self.token_head = head
        return True

    def _scratch(self, step: _Step, rows: int) -> torch.Tensor:
        """One workspace for the layers' scratch buffers (_SCRATCH) of ``rows`` token rows, each part
        rounded up to 16 elements; ``step``'s scratch fields point into it. Returns it (the caller holds
        it while the step runs)."""
        d = self.dims
        cols = {"h": d.hidden, "qkv": self.q_size + 2 * self.kv_size, "q": self.q_size, "attn": self.q_size,
                "gate_up": 2 * d.intermediate, "act": d.intermediate}
        sizes = [-(-rows * cols[k] // 16) * 16 for k in _SCRATCH]
        work = torch.empty(sum(sizes), dtype=self.dtype)
        base, es = work.data_ptr(), work.element_size()
        for k, size in zip(_SCRATCH, sizes):
            setattr(step, k, base)
            base += size * es
        return work

    def _token_step(self, n: int, tokens: StepTokens) -> tuple:
        """(the token steps' _Step, x [cap, hidden], cos_sin [cap, 2, 1, rotary_dim], final [cap, hidden]),
        cap >= n: the struct's scratch and table fields set, kept while n fits and the tables stay
        (``token_tables``); run_tokens and _run set the per-step ones."""
        kept = self.token_step
        if kept is not None and kept[0] >= n:
            return kept[1]
        cap = max(n, 2 * kept[0] if kept is not None else 0)
        d = self.dims
        x, x_out, final = (torch.empty(cap, d.hidden, dtype=self.dtype) for _ in range(3))
        cos_sin = torch.empty(cap, 2, 1, d.rotary_dim, dtype=self.dtype)
        cache = tokens.rope_cache
        step = _Step(x=x.data_ptr(), residual=x.data_ptr(), x_out=x_out.data_ptr(), has_residual=0,
                     cos_sin=(_p * 2)(cos_sin.data_ptr(), cos_sin.data_ptr()), embed=tokens.embed.data_ptr(),
                     rope_cache=cache.data_ptr(), final_norm=tokens.norm_weight.data_ptr(), vocab=tokens.embed.shape[0],
                     max_pos=cache.shape[0], final_eps=float(tokens.norm_eps))
        work = self._scratch(step, cap)
        self.token_step = (cap, (step, x, cos_sin, final), work, x_out)  # (work, x_out: held)
        return self.token_step[1]

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], cos_sin: Any,
            kv_caches: list, meta: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """All layers on x [N, hidden] (and the residual stream [N, hidden], or None before the
        first layer) -> (the last layer's MLP output, the residual stream), as the Python loop
        returns them; None, nothing touched, when this step is not one it covers. ``cos_sin``: the
        RoPE table at the step's positions [N, 2, 1, rotary_dim], or (Gemma) id(RotaryEmbedding) ->
        its table. Gemma: x is the residual stream, updated in place (the first item is scratch)."""
        return self._run(x, residual, cos_sin, kv_caches, meta, None)

    def _run(self, x: torch.Tensor, residual: Optional[torch.Tensor], cos_sin: Any, kv_caches: list, meta: Any,
             token_step: Optional[_Step]) -> Optional[tuple[Optional[torch.Tensor], torch.Tensor]]:
        """``run``; ``token_step``: run_tokens' struct (x and cos_sin are its scratch, filled by the C
        call; the first item returned is then None)."""
        if (meta.block_tables is None or cos_sin is None or x.dtype != self.dtype or not x.is_cpu or x.dim() != 2
                or not x.is_contiguous() or (residual is not None and not residual.is_contiguous())
                or (self.gemma and residual is not None)):
            return None
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return None  # the int8 layers leave their panels for oneDNN's GEMM in the loop
        with_lora = self.lora is not None and self.lora.ctx.step is not None
        if with_lora and self.lora_tables is None:
            return None  # adapters the runner cannot add (attach_lora's reason): the loop's hooks add them
        layers = self._layer_structs(kv_caches, meta.block_size)
        if layers is None:
            return None
        bt, sl, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc
        tables = [cos_sin.get(id(r)) for r in self.ropes] if isinstance(cos_sin, dict) else [cos_sin]
        if any(t is None for t in tables) or len(tables) != len(self.ropes):
            return None
        tables = [t.contiguous() for t in tables]
        slots = meta.slot_mapping.contiguous()
        if (bt.dtype != torch.int32 or sl.dtype != torch.int32 or qsl.dtype != torch.int32
                or slots.dtype != torch.int64 or not bt.is_contiguous()
                or any(t.dtype != self.dtype or t.shape != (x.shape[0], 2, 1, self.dims.rotary_dim) for t in tables)):
            return None
        n, hidden = x.shape
        d = self.dims
        if token_step is not None:
            step, x_out = token_step, None
            step.num_tokens, step.slot_mapping, step.block_tables = n, slots.data_ptr(), bt.data_ptr()
            step.seq_lens, step.query_start_loc, step.bt_stride = sl.data_ptr(), qsl.data_ptr(), bt.stride(0)
            step.num_seqs, step.bad_input, step.lora = sl.shape[0], 0, None
        else:
            x_out = torch.empty(n, hidden, dtype=self.dtype)
            step = _Step(num_tokens=n, x=x.data_ptr(), residual=(x if residual is None else residual).data_ptr(),
                         x_out=x_out.data_ptr(), has_residual=int(residual is not None),
                         cos_sin=(_p * 2)(*(t.data_ptr() for t in (tables * 2)[:2])),
                         slot_mapping=slots.data_ptr(), block_tables=bt.data_ptr(), seq_lens=sl.data_ptr(),
                         query_start_loc=qsl.data_ptr(), bt_stride=bt.stride(0), num_seqs=sl.shape[0])
            work = self._scratch(step, n)
        step.timings = ctypes.addressof(self.timings) if self.timings is not None else None
        lora_held: list = []
        if with_lora:
            lora_step, lora_held = self._lora_step()
            step.lora = ctypes.pointer(lora_step)
        self.run_layers(ctypes.byref(self.kernels), ctypes.byref(d), layers, len(layers), ctypes.byref(step))
        if step.bad_input:
            return None
        self.steps_run += 1
        self.lora_steps_run += int(with_lora)
        return x_out, (x if residual is None else residual)

    def timing_on(self) -> None:
        """From now on each step adds its phases' wall time (seconds, summed over the layers) to
        ``phase_seconds()``; two clock reads a phase."""
        self.timings = (ctypes.c_double * len(GEMMA_PHASES))()

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase (``self.phases``: PHASES, or GEMMA_PHASES) since ``timing_on``, summed
        over layers and steps."""
        return {p: t for p, t in zip(self.phases, self.timings) if p} if self.timings is not None else {}


def run_layers(model: Any, x: Optional[torch.Tensor], residual: Optional[torch.Tensor], cos_sin: Any,
               kv_caches: list, meta: Any, lora: Optional[Any] = None,
               tokens: Optional[StepTokens] = None) -> Any:
    """``model``'s decoder layers through its runner (built and checked on first use; why not,
    logged once), or None: the caller runs its Python loop. Arguments as ``CpuLayerRunner.run``;
    ``lora``: the LoRA runtime whose adapters the steps add (``CpuLayerRunner.attach_lora``), or None.
    ``tokens``: the whole step from its tokens (x, residual and cos_sin None): ``CpuLayerRunner.run_tokens``,
    the model's final hidden states or None (the caller then embeds and calls again)."""
    if not getattr(model, "use_cpu_layer_runner", True) or not (tokens.input_ids if x is None else x).is_cpu:
        return None
    runner = model.__dict__.get("_cpu_layer_runner")
    if runner is None:
        runner, why = CpuLayerRunner.build(model)
        model.__dict__["_cpu_layer_runner"] = runner or False
        logger.info("cpu layer runner: %s", "on (all decoder layers in one C call a step)" if runner
                    else f"off ({why})")
    if not runner:
        return None
    if lora is not None and runner.lora is not lora:
        why = runner.attach_lora(lora)
        logger.info("cpu layer runner: %s", f"steps with LoRA tokens run the Python loop ({why})" if why
                    else "LoRA adapters added inside the layer loop (platforms/cpu/lora_ops.cpp)")
    if tokens is not None:
        return runner.run_tokens(tokens, kv_caches, meta)
    return runner.run(x, residual, cos_sin, kv_caches, meta)


def layer_stack(model: Any, lora: Optional[Any] = None) -> Callable[..., Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """What the model runner sets as ``model.layer_stack`` on a CPU: ``(x, residual, cos_sin, kv_caches,
    meta) -> (x, residual)`` through ``model``'s runner (``run_layers``), or None where the step or the
    model is not one it covers (the model then runs its Python layer loop). The runner is built, and
    whether it applies logged, on the first call (``model.use_cpu_layer_runner = False`` defers both).
    ``lora``: under --enable-lora, the LoRA runtime whose adapters the runner adds in its loop."""
    return functools.partial(run_layers, model, lora=lora)
