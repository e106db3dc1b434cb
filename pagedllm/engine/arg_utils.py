"""What a user sets, each setting written once: ``EngineArgs`` (the engine) and ``ServerArgs`` (the server only).

Every field carries its type, default and help. From the fields come ``pagedllm serve`` / ``run-batch``'s
flags (``add_cli_args``: ``--max-model-len`` for ``max_model_len``, plus any short alias), the values read
back from parsed flags (``from_cli_args``) and the keywords ``LLM(...)`` takes (the EngineArgs fields). A
new setting is one field here.

``EngineArgs.create_engine_config()`` validates the settings and resolves them (model path, dtype, context
length, KV-cache budget, threads) into the ``EngineConfig`` of ``pagedllm/config.py``, or raises ValueError.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from pagedllm import envs
from pagedllm.config import (DEFAULT_BLOCK_SIZE, DEMO_MODEL_PATH, DTYPE_NAMES, CacheConfig, EngineConfig, LoRAConfig,
                             ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig)
from pagedllm.layers.attention.kv_quant import CHOICES as KV_CACHE_DTYPES
from pagedllm.layers.attention.selector import CHOICES as ATTENTION_BACKENDS
from pagedllm.layers.quantization import get_quantization_config
from pagedllm.models.checkpoint import load_hf_config, local_model_path, looks_like_local_path
from pagedllm.models.gguf import is_gguf_file, one_line
from pagedllm.models.mtp import num_mtp_layers
from pagedllm.models.registry import get_model_class
from pagedllm.platforms.cpu.cpu_info import cpu_bf16_gemm, cpu_has_native_bf16
from pagedllm.platforms.cpu.threads import resolve_num_threads
from pagedllm.spec_decode.config import check_mtp_checkpoint, parse_json_setting, parse_speculative_config
from pagedllm.worker.kv_cache_budget import cpu_kv_cache_space_bytes

RUNNERS = ("generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")

# ---- sizes and the field helper ----------------------------------------------------------------------
_SIZE_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mib": 2 ** 20, "g": 2 ** 30,
               "gib": 2 ** 30, "t": 2 ** 40, "tib": 2 ** 40, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9,
               "tb": 10 ** 12}


def parse_size(value: str) -> int:
    """Bytes from '1073741824', '512MiB', '4M', '2G', '1.5GB' (K/M/G/KiB.. binary, KB/MB/GB decimal).

    Raises:
        argparse.ArgumentTypeError: not a size, or not positive (argparse shows it as the flag's error).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {value!r} (e.g. 1073741824, 512MiB, 2GiB)")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {value!r}")
    return n


def setting(default: Any, help: str, *, aliases: Sequence[str] = (), type: Optional[Callable[[str], Any]] = None,
            choices: Optional[Sequence[str]] = None, auto_is_none: bool = False, positional: bool = False,
            nargs: Optional[str] = None, merge: bool = False) -> Any:
    """A dataclass field that is also a CLI flag.

    Args:
        default: the field's default (and the flag's).
        help: the flag's help text, also the field's documentation (``LLM``'s docstring lists it).
        aliases: more option strings besides ``--field-name`` (e.g. ``-tp``).
        type: the flag's string -> value conversion; default: the annotation's int or float (str: none).
        choices: the values the flag accepts.
        auto_is_none: the flag's default is "auto", which means the field's None.
        positional: an optional positional argument (``pagedllm serve MODEL``) instead of a flag.
        nargs: argparse's nargs ("+": a flag taking one or more values, a list field).
        merge: a JSON-config flag that may be given several times (``type`` makes each a dict; the
            field is their union, later keys winning: ``--x '{"a": 1}' --x b=2``).
    """
    return field(default=default, metadata={"help": help, "aliases": tuple(aliases), "type": type,
                                            "choices": choices, "auto_is_none": auto_is_none,
                                            "positional": positional, "nargs": nargs,
                                            "merge": merge})


def cli_flag(name: str) -> str:
    """The flag of a field: ``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def _base_type(hint: Any) -> Any:
    """int for ``Optional[int]``, the hint itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


class CliArgs:
    """Flags from a dataclass's ``setting`` fields, and the dataclass from parsed flags."""

    @classmethod
    def add_cli_args(cls, parser: Any) -> Any:
        """Add one argument per field to ``parser`` (an ArgumentParser or an argument group); returns it.
        A bool field is ``--x/--no-x`` when it defaults to True, else ``--x`` (store_true)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            m = f.metadata
            kwargs: dict[str, Any] = {"help": m["help"], "default": "auto" if m["auto_is_none"] else f.default}
            if m["choices"] is not None:
                kwargs["choices"] = list(m["choices"])
            base = _base_type(hints[f.name])
            if base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            elif m["type"] is not None or base in (int, float):
                kwargs["type"] = m["type"] or base
            if m.get("nargs"):
                kwargs["nargs"] = m["nargs"]
            if m.get("merge"):
                kwargs["action"] = "append"
            if m["positional"]:
                parser.add_argument(f.name, nargs="?", **kwargs)
            else:
                parser.add_argument(cli_flag(f.name), *m["aliases"], **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The dataclass from a namespace parsed by a parser ``add_cli_args`` built (AttributeError when a field's
        argument is missing from it); an ``auto_is_none`` flag's "auto" becomes None."""
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name)
            if f.metadata.get("merge") and isinstance(value, list):  # several JSON-config values: one dict
                value = {k: v for part in value for k, v in part.items()}
            values[f.name] = None if f.metadata["auto_is_none"] and value == "auto" else value
        return cls(**values)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


# ---- model path, dtype, context length -----------------------------------------------------------
def resolve_model_path(model: Optional[str]) -> str:
    """Local folder or GGUF file for ``model``: the bundled demo model when None, the path itself
    when it exists (the .gguf inside a folder holding one and no config.json), else a Hugging Face
    hub id fetched with ``huggingface_hub`` (needs internet).

    Raises:
        ValueError: the path does not exist (and cannot be a hub id), or the hub download failed.
    """
    if model is None:
        return DEMO_MODEL_PATH
    if os.path.exists(model) or looks_like_local_path(model):
        return local_model_path(model)
    try:
        from huggingface_hub import snapshot_download  # lazily: only a hub id needs it (and the network)

        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        raise ValueError(f"model {model!r} is not a local path and could not be fetched from "
                         f"the Hugging Face hub ({type(e).__name__}: {one_line(e)})") from None


def resolve_dtype(dtype: Any, hf_config: Any, device: str) -> tuple[torch.dtype, str]:
    """(weight/activation/KV-cache dtype, why it was chosen, for the start-up log).

    ``auto`` on a CPU: bfloat16 where the CPU has native bf16 matmuls (AVX512-BF16 or AMX, where a
    bf16 matmul runs about 2x fp32), else float32; the environment variable ``PAGEDLLM_CPU_AUTO_DTYPE``
    (float32 or bfloat16) overrides that choice. ``auto`` on CUDA: the checkpoint's dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype, "given"
    dtype = (dtype or "auto").lower()
    if dtype == "auto":
        if device == "cpu":
            forced = envs.PAGEDLLM_CPU_AUTO_DTYPE  # "" when unset; a bad name raises ValueError there
            if forced:
                return DTYPE_NAMES[forced], f"auto: PAGEDLLM_CPU_AUTO_DTYPE={forced}"
            if cpu_has_native_bf16():
                return torch.bfloat16, "auto: this CPU has native bf16 matmuls (avx512_bf16/amx_bf16)"
            why = "auto: no native bf16 matmuls on this CPU (avx512_bf16/amx_bf16 absent)"
            if cpu_bf16_gemm():
                why += "; --dtype bfloat16 halves the weights and runs on our GEMM here (widened to float32)"
            return torch.float32, why
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = DTYPE_NAMES.get(cfg)
        if isinstance(cfg, torch.dtype):
            return cfg, "auto: the checkpoint's dtype"
        return torch.float32, "auto: the checkpoint names no dtype"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return DTYPE_NAMES[dtype], "given"


def _max_len_from_hf(hf_config: Any) -> int:
    """The context length a Hugging Face config states (2048 when it names none)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


# ---- the engine's settings -----------------------------------------------------------------------
@dataclass
class EngineArgs(CliArgs):
    """User-facing engine settings (``LLM(...)`` keywords, ``pagedllm serve`` flags); defaults follow vLLM
    where it has one."""

    model: Optional[str] = setting(
        None, "local Hugging Face model folder, GGUF file (or a folder holding one) or hub id; "
              "omitted = the bundled demo model", positional=True)
    served_model_name: Optional[str] = setting(None, "model name in the API (default: the MODEL argument)")
    tokenizer: Optional[str] = setting(
        None, "tokenizer folder, GGUF file or hub id (default: the model's; a GGUF's from its metadata)")
    dtype: str = setting(
        "auto", "weight/activation/KV-cache dtype; auto = the checkpoint's on GPU; on a CPU bfloat16 where "
                "it has native bf16 matmuls (avx512_bf16/amx_bf16), else float32 (default: auto)",
        choices=("auto", "float32", "bfloat16", "float16", "half", "float"))  # half, float: vLLM's names
    attention_backend: str = setting(
        "auto", "paged-attention backend; auto = the compiled CPU kernel on a CPU when it builds, "
                "else the pure-PyTorch reference (torch)", choices=ATTENTION_BACKENDS)
    kv_cache_dtype: str = setting(
        "auto", "KV-cache storage; auto = the model's dtype; int8 = int8 values and a float32 scale per "
                "token and KV head (at head_dim 64: 3.8x the tokens of float32 in the same memory, 1.9x "
                "bfloat16's)", choices=KV_CACHE_DTYPES)
    device: Optional[str] = setting(None, "device to run on", choices=("auto", "cuda", "cpu"), auto_is_none=True)
    scheduling_policy: str = setting(
        "fcfs", "fcfs = arrival order; priority = each request's priority field first (lower runs "
                "first), then arrival; the least urgent running request is the one preempted",
        choices=SCHEDULING_POLICIES)
    runner: str = setting(
        "generate", "generate = text (completions, chat, responses); pooling = an embedding model served on "
                    "/v1/embeddings (each input's last hidden state, L2-normalized)", choices=RUNNERS)
    load_format: str = setting("auto", "dummy = random weights of the model's shape (no weight files needed)",
                               choices=LOAD_FORMATS)
    quantization: Optional[str] = setting(
        None, "int8 = W8A8: int8 weights (per output channel) and activations (per token), int32 "
              "matmuls, after SmoothQuant smoothing calibrated at load (PAGEDLLM_SMOOTHQUANT_ALPHA=0: "
              "off; then a GGUF file's Q8_0 blocks go straight in); int8-g64: activation scales per "
              "token and group of 64 features (slower prefill) (default: none)",
        aliases=("-q",), choices=("int8", "int8-g64", "none"))
    max_model_len: Optional[int] = setting(
        None, "context length (prompt + output); default: the model's max_position_embeddings")
    tensor_parallel_size: int = setting(
        1, "tensor-parallel ranks: GPUs, or CPU processes (cores split between them)", aliases=("-tp",))
    pipeline_parallel_size: int = setting(
        1, "pipeline stages (the layers split over processes/GPUs; world size = TP x PP)", aliases=("-pp",))
    distributed_executor_backend: str = setting(
        "mp", "how TP/PP worker ranks start: mp = local processes (multi-node: --nnodes), ray = Ray "
              "actors in a placement group on the running cluster (ray start --head) or a local one",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    nnodes: int = setting(1, "nodes in a multi-node launch (every node runs `pagedllm serve` with the same "
                             "flags; world size TP x PP split evenly over the nodes)")
    node_rank: int = setting(0, "this node's rank; node 0 serves the API")
    master_addr: Optional[str] = setting(None, "node 0's address, reachable from every node (multi-node)")
    master_port: Optional[int] = setting(None, "free port on node 0 for the torch.distributed rendezvous "
                                               "(multi-node)")
    gpu_memory_utilization: Optional[float] = setting(
        None, "fraction of GPU memory (of RAM on a CPU) for weights + activations + KV cache "
              "(default: 0.9). On a CPU, when neither this nor --kv-cache-memory is given, the KV cache "
              "has a fixed size instead: 4 GiB, or PAGEDLLM_CPU_KVCACHE_SPACE GiB")
    kv_cache_memory: Optional[int] = setting(
        None, "KV-cache size in bytes (e.g. 2GiB); overrides --gpu-memory-utilization", type=parse_size)
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV-cache block")
    num_threads: Optional[int] = setting(
        None, "CPU threads for the model (default: OMP_NUM_THREADS if set, else the physical cores)")
    max_num_seqs: int = setting(256, "maximum sequences in the running batch")
    stream_interval: int = setting(
        1, "tokens a streamed request gathers before its next output (vLLM's --stream-interval): an output "
           "goes out for a request's first token, when it finishes, and whenever one of its samples has this "
           "many tokens more than at its last output; 1 = every token. Larger values send several tokens per "
           "SSE event: less HTTP, JSON and client work per token, the same text")
    enforce_eager: bool = setting(
        False, "run every step eagerly: no CUDA graphs of decode steps (on CUDA with a graph-safe attention "
               "backend, triton or flash-attn, decode batches up to max_num_seqs (at most 512) are captured at "
               "sizes 1, 2, 4, 8, 16, 24, ... and replayed; a CPU never uses graphs)")
    max_num_batched_tokens: Optional[int] = setting(
        None, "token budget of one engine step (default: 2048 on a CPU, else max(2048, min(max_model_len, 8192)))")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    seed: int = setting(0, "random seed (weights of --load-format dummy, sampling)")
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT folders) beside the base model: --lora-modules, LoRARequest offline, "
               "/v1/load_lora_adapter; a request picks one by its model name")
    max_loras: int = setting(1, "LoRA: most adapters one step serves at once (GPU/CPU slots)")
    max_lora_rank: int = setting(16, "LoRA: largest adapter rank accepted (a larger one is refused)")
    max_cpu_loras: Optional[int] = setting(
        None, "LoRA: adapters kept loaded in CPU memory, least recently used evicted (default: max_loras)")
    speculative_config: Optional[Any] = setting(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4} (proposals copied from the request's own prompt and output) or "
              "{\"method\": \"draft_model\", \"model\": DRAFT, \"num_speculative_tokens\": 4} (a smaller model "
              "of the same vocabulary) or {\"method\": \"mtp\", \"num_speculative_tokens\": 3} (the checkpoint's "
              "own multi-token-prediction layer: DeepSeek-V3/R1, GLM-4.5, MiMo); \"disable_by_batch_size\": N "
              "turns proposals off in steps with more than N running sequences. The output follows the model's distribution exactly (greedy: the "
              "same tokens): speed only", type=parse_json_setting, merge=True)
    limit_mm_per_prompt: Optional[dict] = setting(
        None, "the most images one prompt may carry, as JSON ('{\"image\": 2}') or image=2; a request with "
              "more is refused (400). Default: 4 images for an image-text model; 0 refuses images",
        type=parse_json_setting, merge=True)
    allowed_local_media_path: Optional[str] = setting(
        None, "a folder whose files image URLs may name as file:// (default: none, file:// URLs are refused)")
    allow_remote_media: bool = setting(
        False, "fetch http(s) image URLs named in requests (default: off, only data: and file:// URLs); "
               "size and pixel limits: PAGEDLLM_MAX_IMAGE_BYTES, PAGEDLLM_MAX_IMAGE_PIXELS")
    max_logprobs: int = setting(
        20, "the most logprobs (top_logprobs on chat) or prompt_logprobs a request may ask for; more "
            "is refused (400). The default, 20, is OpenAI's cap (default: 20)")

    def create_engine_config(self) -> EngineConfig:
        """Validate and resolve the settings (loads the model's config, not its weights).

        Raises:
            ValueError: an invalid setting, a model that is not there or not supported (one line naming it).
        """
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        max_len_cfg = _max_len_from_hf(hf_config)
        max_model_len = max_len_cfg if self.max_model_len is None else self.max_model_len  # 0 is refused below
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        utilization = 0.9 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool)
                                                 or not isinstance(self.kv_cache_memory, (int, float))):
            raise ValueError(f"kv_cache_memory must be a number of bytes, got {self.kv_cache_memory!r} (the CLI's "
                             f"--kv-cache-memory also takes sizes such as 512MiB)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) or \
                self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        layers = getattr(hf_config, "num_hidden_layers", None)
        if layers is not None and self.pipeline_parallel_size > layers:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} exceeds the model's {layers} "
                             f"layers (each stage needs at least one)")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes; got nnodes={self.nnodes}, "
                             f"node_rank={self.node_rank}")
        if world % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} ranks do not split evenly "
                             f"over nnodes={self.nnodes}")
        if self.nnodes > 1 and (not self.master_addr or not self.master_port):
            raise ValueError("a multi-node launch (nnodes > 1) needs master_addr and master_port (the address of "
                             "node 0, reachable from every node)")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("with the ray backend the Ray cluster spans the nodes: drop --nnodes")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got "
                             f"{self.scheduling_policy!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be auto, safetensors or dummy; got {self.load_format!r}")
        lora_config = self.lora_config()
        get_quantization_config(self.quantization)  # raises ValueError for an unknown name
        get_model_class(hf_config, max_model_len)  # an unsupported architecture fails here, before any loading
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                             f"{self.kv_cache_dtype!r}")
        # Tokens per step. On a CPU 2,048: larger steps ran slower per token (SmolLM2, W48 offline,
        # 5,972 prompt tokens: fp32 8 %, int8 W8A8 15-20 % slower in one 8,192-token step than in
        # chunks of 2,048; their activations outgrow the caches).
        max_batched = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else (
            2048 if device == "cpu" else max(2048, min(max_model_len, 8192)))
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_batched}")
        dtype, dtype_reason = resolve_dtype(self.dtype, hf_config, device)
        cpu_space, cpu_space_reason = None, ""
        threads, threads_reason = 0, ""
        if device == "cpu":
            if self.kv_cache_memory is None and self.gpu_memory_utilization is None:
                cpu_space, cpu_space_reason = cpu_kv_cache_space_bytes()
            threads, threads_reason = resolve_num_threads(self.num_threads)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=self.tokenizer or model_path,
            hf_config=hf_config,
            dtype=dtype,
            dtype_reason=dtype_reason,
            max_model_len=max_model_len,
            served_model_name=self.served_model_name or (self.model or "shakespeare-llama"),
            load_format=self.load_format,
            seed=self.seed,
            quantization=None if self.quantization == "none" else self.quantization,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs,
            runner=self.runner,
            lora_enabled=lora_config is not None,
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            allowed_local_media_path=self.allowed_local_media_path,
            allow_remote_media=self.allow_remote_media,
        )
        if model_config.is_multimodal and self.pipeline_parallel_size > 1:
            # (pp_runner's first stage embeds token ids only: image rows would keep their placeholders)
            arch = getattr(model_config.hf_config, "text_only_of", None) or model_config.architecture
            raise ValueError(f"{arch}: image input with pipeline_parallel_size > 1 is not supported; use "
                             f"tensor_parallel_size instead")
        speculative = self._speculative_config(model_config)
        return EngineConfig(
            speculative_config=speculative,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=utilization,
                kv_cache_memory=self.kv_cache_memory,
                cpu_kv_cache_space=cpu_space,
                cpu_kv_cache_space_reason=cpu_space_reason,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
                max_loras=lora_config.max_loras if lora_config else 0,
                stream_interval=self.stream_interval,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           pipeline_parallel_size=self.pipeline_parallel_size,
                                           nnodes=self.nnodes, node_rank=self.node_rank,
                                           master_addr=self.master_addr, master_port=self.master_port,
                                           distributed_executor_backend=self.distributed_executor_backend,
                                           num_threads=threads, num_threads_reason=threads_reason),
            device=device,
            lora_config=lora_config,
        )

    def lora_config(self) -> Optional[LoRAConfig]:
        """The LoRA settings under enable_lora (None without). Raises ValueError on a bad size."""
        if not self.enable_lora:
            return None
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu!r}) must be an integer >= max_loras ({self.max_loras})")
        if self.runner != "generate":
            raise ValueError("LoRA adapters serve the generate runner only")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=cpu,
                          op_mode=envs.PAGEDLLM_LORA_OP)

    def _speculative_config(self, target: ModelConfig) -> Optional[SpeculativeConfig]:
        """``speculative_config`` parsed (spec_decode/config.py), its draft's ModelConfig resolved (the
        target's dtype and context length). Raises ValueError for what speculation cannot serve here."""
        spec = parse_speculative_config(self.speculative_config)
        if spec is None:
            return None
        if self.runner == "pooling":
            raise ValueError("speculative_config: the pooling runner samples no tokens")
        if self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1")
        if spec.method == "draft_model":
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config: a draft model with tensor_parallel_size > 1 is not supported")
            path = resolve_model_path(spec.model)
            hf = load_hf_config(path)
            get_model_class(hf, target.max_model_len)
            get_quantization_config(spec.draft_quantization)
            if hf.vocab_size != target.hf_config.vocab_size:
                raise ValueError(f"speculative_config: the draft model {spec.model} has a vocabulary of "
                                 f"{hf.vocab_size} tokens, the target {target.hf_config.vocab_size}: it must share "
                                 f"the target's tokenizer")
            spec.draft_model_config = dataclasses.replace(
                target, model=path, tokenizer=target.tokenizer, hf_config=hf, served_model_name=spec.model,
                quantization=spec.draft_quantization, dtype_reason="the target's")
        elif spec.method == "mtp":
            self._check_mtp(spec, target)
        return spec

    def _check_mtp(self, spec: SpeculativeConfig, target: ModelConfig) -> None:
        """The mtp method: the target checkpoint's own MTP layer, beside the unsharded model (k defaults to
        its ``num_nextn_predict_layers``, as vLLM's). Raises ValueError for what it cannot serve."""
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: method mtp with tensor_parallel_size > 1 is not supported")
        if is_gguf_file(target.model):
            raise ValueError("speculative_config: method mtp reads the MTP layer from safetensors checkpoints, "
                             "not GGUF files")
        check_mtp_checkpoint(target.hf_config, get_model_class(target.hf_config, target.max_model_len))
        if spec.model is not None and os.path.realpath(resolve_model_path(spec.model)) != os.path.realpath(
                target.model):
            raise ValueError(f"speculative_config: method mtp runs the target's own layers; model "
                             f"{spec.model!r} is another checkpoint (leave it out, or use draft_model)")
        if not spec.num_speculative_tokens:
            spec.num_speculative_tokens = num_mtp_layers(target.hf_config)

# ---- the server's settings -----------------------------------------------------------------------
@dataclass
class ServerArgs(CliArgs):
    """The options of ``pagedllm serve`` (and ``run-batch``) that are not engine settings: HTTP, API key,
    chat template, tool and reasoning parsers, the Responses store, CORS, logging, data parallelism."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = setting(8000, "port to listen on")
    api_key: Optional[str] = setting(
        None, "require 'Authorization: Bearer KEY' on /v1/* (default: env PAGEDLLM_API_KEY, else none)")
    headless: bool = setting(
        False, "run this node's worker ranks only (no API server); for nodes with --node-rank >= 1")
    data_parallel_size: int = setting(
        1, "engine replicas (processes, each with its own model copy, KV cache and cores / N "
           "threads) behind this one server; requests go to the least-loaded replica", aliases=("-dp",))
    engine_core_process: bool = setting(
        True, "run the engine core (scheduler + model) in its own process, the API server process tokenizing, "
              "detokenizing and streaming, ZeroMQ + msgspec between them (vLLM V1's layout); "
              "--no-engine-core-process (or env PAGEDLLM_ENABLE_MULTIPROCESSING=0): in a thread of the server "
              "process")
    chat_template: Optional[str] = setting(
        None, "Jinja chat template file (or inline template); default: the tokenizer's")
    enable_auto_tool_choice: bool = setting(
        False, 'let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    tool_call_parser: Optional[str] = setting(
        None, "how tool calls are read from the model's text: hermes, llama3_json, openai (gpt-oss)")
    reasoning_parser: Optional[str] = setting(
        None, "split a reasoning model's <think>...</think> into message.reasoning (deepseek_r1: the "
              "opening tag optional; qwen3: only an output that opens with it); openai_gptoss: gpt-oss's "
              "analysis channel")
    max_request_bytes: int = setting(4 * 2 ** 20, "largest accepted request body; bigger ones get 413",
                                     type=parse_size)
    shutdown_timeout: float = setting(
        10.0, "seconds to let in-flight requests finish on SIGINT/SIGTERM before aborting them")
    max_stored_responses: int = setting(
        1024, "Responses API: most responses kept for previous_response_id and GET (oldest evicted)")
    stored_response_ttl: float = setting(3600.0, "Responses API: seconds a stored response is kept")
    max_stored_response_bytes: int = setting(
        256 * 2 ** 20, "Responses API: most bytes the stored responses may hold (response objects, input "
                       "items, conversations and background events, as JSON; oldest evicted first); e.g. 256MiB",
        type=parse_size)
    dashboard: bool = setting(True, "serve the live block-pool dashboard at /dashboard (--no-dashboard: off)")
    # HTTP limits (uvicorn's names) and CORS (vLLM's flags and defaults)
    timeout_keep_alive: float = setting(5.0, "seconds an idle keep-alive connection stays open between requests")
    timeout_request_read: float = setting(
        30.0, "seconds a client has to send a whole request (headers and body) before its connection "
              "is closed; 0 = no limit")
    limit_concurrency: int = setting(1000, "most open HTTP connections; more get 503 and are closed; 0 = no limit")
    h11_max_incomplete_event_size: int = setting(
        16 * 2 ** 10, "h11's bound on a request line plus headers not yet complete in its buffer, in bytes "
                      "(uvicorn's option, as vLLM's): a client still sending them past it gets a 400 and is "
                      "disconnected; headers that arrive complete in one read are not measured against it",
        type=parse_size)
    allowed_origins: str = setting(
        '["*"]', "CORS: origins allowed to call the API from a browser (JSON list or comma-separated)")
    allowed_methods: str = setting('["*"]', "CORS: allowed HTTP methods")
    allowed_headers: str = setting('["*"]', "CORS: allowed request headers")
    allow_credentials: bool = setting(False, "CORS: allow cookies and credentials")
    log_level: str = setting("info", "log level of pagedllm and uvicorn",
                             choices=("debug", "info", "warning", "error", "critical"))
    disable_access_log: bool = setting(False, "do not log one line per HTTP request")
    # vLLM's response details and ops routes (their flags)
    enable_prompt_tokens_details: bool = setting(
        False, "report usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache")
    lora_modules: Optional[list] = setting(
        None, "LoRA adapters served under their own model names (with --enable-lora): name=path, or JSON "
              '{"name": ..., "path": ..., "base_model_name": ...}; one or more', nargs="+")
    allow_runtime_lora_updating: bool = setting(
        False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also env "
               "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING or VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    enable_server_load_tracking: bool = setting(
        False, "count in-flight inference requests for GET /load ({\"server_load\": N}; 0 without this flag)")
    json_additional_properties: str = setting(
        "forbid", "what a JSON schema's objects that do not say additionalProperties do with keys they do not "
                  "declare (response_format, guided_json, forced tool calls): forbid (vLLM's default: xgrammar's "
                  "strict mode) or allow (vLLM's guidance backend). vLLM's --structured-outputs-config "
                  "backend=guidance / disable_additional_properties=true set it; a request's "
                  "structured_outputs.disable_additional_properties or strict: true forbids",
        choices=("forbid", "allow"))
    enable_tokenizer_info_endpoint: bool = setting(
        False, "serve GET /tokenizer_info: the tokenizer's configuration (may show the chat template)")
