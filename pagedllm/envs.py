"""Which environment variables does pagedllm read, and what does each do? All of them, in one table.

Every ``PAGEDLLM_*`` variable the package reads is declared once in ``ENVIRONMENT_VARIABLES`` (name ->
type, default, parser, help) and read as an attribute of this module: ``envs.PAGEDLLM_TP_TIMEOUT_S``
parses ``os.environ`` at that moment (module ``__getattr__``, as vLLM's ``vllm/envs.py``), so a value
set or monkeypatched later is seen by the next read. A module that wants a value fixed for the whole
process reads it once at import (``fused_ops.ENABLED = envs.PAGEDLLM_CPU_FUSED_OPS``) and says so.
``environment_variables()`` lists the table for a generated docs page.

Parsers keep each variable's historical rules exactly: a switch is off only for the text ``0`` (any
other value, the empty one included, keeps it on); a number that does not parse raises ValueError naming
the variable (the timeouts raise Python's own float() error, as they always did).

This module is a leaf: it imports only the standard library, so every layer may import it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional


class EnvVar(NamedTuple):
    """One variable: ``type`` and ``default`` as documented (text), ``parse`` maps the raw value
    (``os.environ.get(name, default)``; None when unset without a default) to what the package uses."""
    type: str
    default: Optional[str]
    parse: Callable[[Optional[str]], Any]
    help: str


def _switch(raw: Optional[str]) -> bool:
    return raw != "0"  # historical rule: only "0" turns a switch off


def _kvcache_space(raw: Optional[str]) -> Optional[float]:
    raw = (raw or "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"PAGEDLLM_CPU_KVCACHE_SPACE must be a positive number of GiB, got {raw!r}")
    return gib


def _lora_op(raw: Optional[str]) -> str:
    mode = (raw or "auto").strip().lower()
    if mode not in ("auto", "grouped", "bmm"):
        raise ValueError(f"PAGEDLLM_LORA_OP must be auto, grouped or bmm; got {raw!r}")
    return mode


def _runtime_lora_updating(raw: Optional[str]) -> bool:
    if raw is None:  # vLLM's variable, as an alias
        raw = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return (raw or "").strip().lower() in ("1", "true")


# The dtype names --dtype accepts (config.DTYPE_NAMES's keys; tests/test_envs.py checks they agree): the message
# names the two that make sense on a CPU, but every one of them has always been accepted.
AUTO_DTYPE_NAMES = ("float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")


def _auto_dtype(raw: Optional[str]) -> str:
    forced = (raw or "").strip().lower()
    if forced and forced not in AUTO_DTYPE_NAMES:
        raise ValueError(f"PAGEDLLM_CPU_AUTO_DTYPE must be float32 or bfloat16; got {forced!r}")
    return forced


def _smoothquant_alpha(raw: Optional[str]) -> Optional[float]:
    if raw is None or raw == "":
        return None
    try:
        alpha = float(raw)
    except ValueError:
        alpha = -1.0
    if not (alpha == 0 or 0 < alpha < 1):
        raise ValueError(f"PAGEDLLM_SMOOTHQUANT_ALPHA must be 0 (off) or in (0, 1), got {raw!r}")
    return alpha


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    # --- image inputs (multimodal/media.py) ---
    "PAGEDLLM_MAX_IMAGE_BYTES": EnvVar(
        "int (bytes)", str(20 * 2**20), int,
        "The largest encoded image a request may carry or name (data: URL payload, local file, remote "
        "fetch); a larger one is refused with 400 before it is decoded."),
    "PAGEDLLM_MAX_IMAGE_PIXELS": EnvVar(
        "int (pixels)", "40000000", int,
        "The most pixels (width x height) of one decoded image; a larger one is refused with 400 (read from "
        "the image header, before its pixels are decoded)."),
    "PAGEDLLM_IMAGE_FETCH_TIMEOUT_S": EnvVar(
        "float (seconds)", "10", float,
        "How long fetching one http(s) image URL may take (only under --allow-remote-media)."),
    # --- start-up and distributed timeouts (seconds; float() of the text) ---
    "PAGEDLLM_DP_STARTUP_TIMEOUT_S": EnvVar(
        "float (seconds)", "600", float,
        "How long a data-parallel client (engine/dp_client.py) waits for every engine process to start and "
        "report ready before start-up fails with a timeout error. Read once, at import."),
    "PAGEDLLM_TP_TIMEOUT_S": EnvVar(
        "float (seconds)", "300", float,
        "The timeout of each model collective (all-reduce, all-gather) between tensor/pipeline-parallel "
        "ranks (worker/multiproc_executor.py): a rank hung longer fails the step. Lower it on a cluster to "
        "detect a stuck node sooner. Read when a worker creates its process group."),
    "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S": EnvVar(
        "float (seconds)", "120", float,
        "How long the Ray executor (worker/ray_executor.py) waits for its placement group (one bundle per "
        "rank) to be placed, and for each actor to answer, before start-up fails. Read once, at import."),
    # --- CPU defaults ---
    "PAGEDLLM_CPU_AUTO_DTYPE": EnvVar(
        "choice: float32 | bfloat16 (or another --dtype name; case-insensitive)", None, _auto_dtype,
        "Overrides what ``--dtype auto`` picks on a CPU (bfloat16 where the CPU has native bf16 matmuls, "
        "AVX512-BF16 or AMX, else float32). Unset or empty: that automatic choice. A name --dtype does not "
        "know (float32, bfloat16, or an alias such as bf16 or float16) raises ValueError when the dtype is "
        "resolved."),
    "PAGEDLLM_CPU_KVCACHE_SPACE": EnvVar(
        "float (GiB)", None, _kvcache_space,
        "The KV-cache size per rank on a CPU when neither --kv-cache-memory nor --gpu-memory-utilization is "
        "given (worker/kv_cache_budget.py; vLLM's VLLM_CPU_KVCACHE_SPACE). Unset or empty: 4 GiB. Capped at "
        "half the physical RAM. Not a positive number: ValueError when the cache is sized."),
    "PAGEDLLM_CPU_MALLOC_TUNING": EnvVar(
        "switch (0 = off)", "1", _switch,
        "On Linux/glibc, fix malloc's mmap threshold (256 MiB) and trim threshold (1 GiB) once per process "
        "(platforms/cpu/malloc.py) so freed activation memory is reused instead of returned to the system "
        "and faulted in again at the next step. 0 leaves malloc as it is."),
    # --- CPU kernels (each a switch; 0 falls back to the PyTorch path) ---
    "PAGEDLLM_CPU_FUSED_OPS": EnvVar(
        "switch (0 = off)", "1", _switch,
        "Use the fused C++ CPU kernels (RMSNorm, rotary, SiLU/GELU-and-mul, int8 quantize/epilogue, argmax; "
        "platforms/cpu/fused_ops.py) where they apply; 0 runs the layers' PyTorch code. Read once, at "
        "import (tests set ``fused_ops.ENABLED`` instead)."),
    "PAGEDLLM_CPU_FLOAT_GEMM": EnvVar(
        "switch (0 = off)", "1", _switch,
        "Use our panel GEMM for float32/bfloat16 linear layers where the CPU has AVX-512 (and AVX512-BF16 "
        "for bfloat16; platforms/cpu/float_gemm.py), splitting decode-sized matmuls evenly over the "
        "threads; 0 keeps oneDNN's packed linear. Read once, at import."),
    "PAGEDLLM_CPU_PACKED_LINEAR": EnvVar(
        "switch (0 = off)", "1", _switch,
        "Pack float32/bfloat16 linear weights once after loading into oneDNN's blocked layout (and our "
        "panel GEMM's, see PAGEDLLM_CPU_FLOAT_GEMM; platforms/cpu/ops.py); 0 keeps the "
        "weights as loaded and multiplies with F.linear. Read for each layer as its weights are processed."),
    "PAGEDLLM_CPU_GGUF_KERNELS": EnvVar(
        "switch (0 = off)", "1", _switch,
        "Keep a GGUF file's quantized linear weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in "
        "their ggml blocks, memory-mapped, and multiply them with our int8-dot kernels "
        "(platforms/cpu/gguf_gemm.py; activations quantized to 8 bits per block of 32, of 256 for the "
        "K-quants, as llama.cpp); 0 "
        "dequantizes them to the model's dtype at load. Read when a model is loaded."),
    "PAGEDLLM_CPU_LAYER_RUNNER": EnvVar(
        "switch (0 = off)", "1", _switch,
        "Run all decoder layers of a step in one C++ call on a CPU (platforms/cpu/layer_runner.py) where "
        "every piece of the model's layers runs one of our kernels; 0 runs the Python layer loop. Read once, "
        "at import."),
    # --- quantization ---
    "PAGEDLLM_SMOOTHQUANT_ALPHA": EnvVar(
        "float: 0 or in (0, 1)", None, _smoothquant_alpha,
        "Overrides the SmoothQuant migration strength of ``--quantization int8`` "
        "(layers/quantization/smoothquant.py): unset or empty, the config's alpha (0.65 by default); 0, no "
        "smoothing (plain per-token int8); a value in (0, 1), that alpha. Anything else raises ValueError "
        "when the model is loaded."),
    # --- LoRA ---
    "PAGEDLLM_LORA_OP": EnvVar(
        "str: auto, grouped or bmm", "auto", _lora_op,
        "How the batched LoRA op groups a step's tokens (pagedllm/lora/ops.py): grouped = one shrink and one "
        "expand matmul per adapter; bmm = groups padded, two batched matmuls over gathered A and B; auto = "
        "grouped, the faster at every shape measured (benchmarks/README.md). Read when the engine starts."),
    # --- paths and serving ---
    "PAGEDLLM_CACHE_DIR": EnvVar(
        "path", None, lambda raw: Path(raw) if raw else Path.home() / ".cache" / "pagedllm",
        "Where the C++ CPU kernels built at first use are cached (in its ``kernels/`` folder, one .so per "
        "source, compiler, flags and CPU; platforms/cpu/build.py). Unset or empty: ~/.cache/pagedllm."),
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        "bool (1/true)", None, _runtime_lora_updating,
        "Turns on POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as --allow-runtime-lora-updating "
        "does (with --enable-lora). Unset: vLLM's name, VLLM_ALLOW_RUNTIME_LORA_UPDATING, is read instead."),
    "PAGEDLLM_ENABLE_MULTIPROCESSING": EnvVar(
        "bool", "1", _switch,
        "0: `pagedllm serve` runs the engine core in a thread of the API server process instead of its own "
        "process (the default of --engine-core-process; vLLM's VLLM_ENABLE_V1_MULTIPROCESSING)."),
    "PAGEDLLM_API_KEY": EnvVar(
        "str", None, lambda raw: raw or None,
        "The API key ``pagedllm serve`` requires as 'Authorization: Bearer KEY' on /v1/* when --api-key is "
        "not given (entrypoints/openai/api_server.py). Unset or empty: no key required."),
}


def environment_variables() -> list[tuple[str, EnvVar]]:
    """Every variable, (name, EnvVar), in the table's order: for a generated docs page."""
    return list(ENVIRONMENT_VARIABLES.items())


def raw(name: str) -> Optional[str]:
    """The unparsed text of a declared variable (None when unset), for a message that quotes it as given.

    Raises:
        KeyError: ``name`` is not in the table.
    """
    ENVIRONMENT_VARIABLES[name]  # only declared variables are read
    return os.environ.get(name)


def set_raw(name: str, value: Optional[str]) -> None:
    """Set a declared variable for this process (None: unset it), e.g. a bench that builds one engine
    with a kernel switch off and the next with it on (every access parses the environment anew).

    Raises:
        KeyError: ``name`` is not in the table.
    """
    ENVIRONMENT_VARIABLES[name]
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def __getattr__(name: str) -> Any:
    # Lazy: parse the environment on each access, so a change after import is seen.
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.parse(os.environ.get(name, var.default))


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])
