"""Engine settings (model, cache, scheduler, parallel), resolved and validated once.

``EngineArgs`` is what a user passes (``LLM(...)`` keywords or ``pagedllm serve`` flags);
``EngineArgs.create_engine_config()`` turns it into an ``EngineConfig`` or raises ValueError.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

DEMO_MODEL_PATH = str(Path(__file__).parent / "assets" / "shakespeare-llama")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_model_path(model: Optional[str]) -> str:
    """Local folder or GGUF file for ``model``: the bundled demo model when None, the path itself
    when it exists (the .gguf inside a folder holding one and no config.json), else a Hugging Face
    hub id fetched with ``huggingface_hub`` (needs internet).

    Raises:
        ValueError: the path does not exist (and cannot be a hub id), or the hub download failed.
    """
    from pagedllm.models.checkpoint import local_model_path, looks_like_local_path

    if model is None:
        return DEMO_MODEL_PATH
    if os.path.exists(model) or looks_like_local_path(model):
        return local_model_path(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        from pagedllm.models.gguf import one_line

        raise ValueError(f"model {model!r} is not a local path and could not be fetched from "
                         f"the Hugging Face hub ({type(e).__name__}: {one_line(e)})") from None


LAYER_TYPES = ("full_attention", "sliding_attention")


def get_rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict:
    """RoPE settings as one dict with ``rope_theta`` and ``rope_type`` (transformers 4.x keeps
    them in ``rope_theta``/``rope_scaling``, 5.x in ``rope_parameters``; a config with one dict per
    layer type, OLMo 3's and Gemma 3's, gives ``layer_type``'s)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if any(t in params for t in LAYER_TYPES):
        params, scaling = dict(params.get(layer_type) or {}), {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = rope_type
    if rope_type == "yarn":  # transformers 5 fills these in rope_parameters; 4.x configs may not
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings",
                          original or getattr(hf_config, "max_position_embeddings", None))
        if params.get("factor") is None:  # DeepSeek-V3: the ratio of the two lengths
            params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    load_format: str = "auto"
    seed: int = 0
    dtype_reason: str = ""  # why ``dtype`` was chosen (start-up log)
    quantization: Optional[str] = None  # a name in layers.quantization.QUANTIZATION_METHODS
    attention_backend: str = "auto"  # see layers/attention/selector.py
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    # "generate" (sample tokens) or "pooling" (embeddings: each prompt's last hidden state, normalized;
    # vLLM's --runner pooling); see layers/pooler.py
    runner: str = "generate"

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else "<none>"

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3: ``kv_lora_rank``): the KV cache holds
        one latent of kv_lora_rank + qk_rope_head_dim channels a token, keys and values at once."""
        return bool(getattr(self.hf_config, "kv_lora_rank", None))

    @property
    def head_dim(self) -> int:
        """Channels of one cached KV head (MLA: the latent's)."""
        c = self.hf_config
        if self.is_mla:
            return c.kv_lora_rank + c.qk_rope_head_dim
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """Cached KV heads (MLA: 1)."""
        c = self.hf_config
        if self.is_mla:
            return 1
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def kv_planes(self) -> int:
        """Tensors a token's cache entry has: K and V (2), or the one latent of MLA (1)."""
        return 1 if self.is_mla else 2


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: Optional[int] = None  # bytes; overrides gpu_memory_utilization
    # CPU only: a fixed KV-cache size in bytes (vLLM's VLLM_CPU_KVCACHE_SPACE), used when neither
    # kv_cache_memory nor gpu_memory_utilization was given; None = size from gpu_memory_utilization.
    cpu_kv_cache_space: Optional[int] = None
    cpu_kv_cache_space_reason: str = ""
    enable_prefix_caching: bool = True
    # "auto" (the model's dtype) or "int8" (values and a float32 scale per token and KV head,
    # layers/attention/kv_quant.py); vLLM's --kv-cache-dtype.
    cache_dtype: str = "auto"
    num_blocks: int = 0  # set once the KV cache is allocated
    # Set with num_blocks: W when every layer has the sliding window W < max_model_len (blocks behind
    # it are freed as a request advances: engine/kv_cache_manager.py), else None.
    sliding_window: Optional[int] = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # "fcfs" (arrival order) or "priority" (each request's priority, lower first, then arrival: vLLM's
    # --scheduling-policy); see engine/scheduler.py
    policy: str = "fcfs"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    num_threads: int = 0  # CPU: torch intra-op threads of this process; 0 = leave torch's setting
    num_threads_reason: str = ""
    pipeline_parallel_size: int = 1  # world size = TP x PP (worker/pp_runner.py)
    # Multi-node (worker/multinode.py): node r runs global ranks [r * L, (r + 1) * L), L = world / nnodes.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    distributed_executor_backend: str = "mp"  # "mp" (worker processes) or "ray" (worker/ray_executor.py)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str


def _max_len_from_hf(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 matrices natively (x86 flags ``avx512_bf16`` or ``amx_bf16``
    in /proc/cpuinfo). Without them PyTorch emulates bf16 matmuls and they run slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:  # not Linux
        pass
    return False


def cpu_bf16_gemm() -> bool:
    """Whether ``float_gemm_cpu`` has a bf16 GEMM on this CPU (AVX512-BF16, or AVX2 widening bf16 to
    float32; builds the library on first use, as loading a model would)."""
    from pagedllm.platforms.cpu import float_gemm as float_gemm_cpu

    lib, _ = float_gemm_cpu._LIBRARY.get()
    return lib is not None and lib.float_gemm_level() >= 2


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
            forced = os.environ.get("PAGEDLLM_CPU_AUTO_DTYPE", "").strip().lower()
            if forced:
                if forced not in _DTYPES:
                    raise ValueError(f"PAGEDLLM_CPU_AUTO_DTYPE must be float32 or bfloat16; got {forced!r}")
                return _DTYPES[forced], f"auto: PAGEDLLM_CPU_AUTO_DTYPE={forced}"
            if cpu_has_native_bf16():
                return torch.bfloat16, "auto: this CPU has native bf16 matmuls (avx512_bf16/amx_bf16)"
            why = "auto: no native bf16 matmuls on this CPU (avx512_bf16/amx_bf16 absent)"
            if cpu_bf16_gemm():
                why += "; --dtype bfloat16 halves the weights and runs on our GEMM here (widened to float32)"
            return torch.float32, why
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        if isinstance(cfg, torch.dtype):
            return cfg, "auto: the checkpoint's dtype"
        return torch.float32, "auto: the checkpoint names no dtype"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[dtype], "given"


RUNNERS = ("generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineArgs:
    """User-facing engine settings; defaults follow vLLM where it has one."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    gpu_memory_utilization: Optional[float] = None  # None: 0.9, or on a CPU the fixed cpu_kv_cache_space
    kv_cache_memory: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    distributed_executor_backend: str = "mp"
    seed: int = 0
    load_format: str = "auto"
    served_model_name: Optional[str] = None
    enable_prefix_caching: bool = True
    device: Optional[str] = None
    num_threads: Optional[int] = None  # CPU threads; None: OMP_NUM_THREADS if set, else the physical cores
    quantization: Optional[str] = None
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    max_logprobs: int = 20
    runner: str = "generate"
    scheduling_policy: str = "fcfs"
    extra: dict = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.models.checkpoint import load_hf_config
        from pagedllm.models.registry import get_model_class

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
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("with the ray backend the Ray cluster spans the nodes: drop --nnodes")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got "
                             f"{self.scheduling_policy!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy; got {self.load_format!r}")
        from pagedllm.layers.quantization import get_quantization_config

        get_quantization_config(self.quantization)  # raises ValueError for an unknown name
        get_model_class(hf_config, max_model_len)  # an unsupported architecture fails here, before any loading
        from pagedllm.layers.attention.selector import CHOICES as attention_backends

        if self.attention_backend not in attention_backends:
            raise ValueError(f"attention_backend must be one of {', '.join(attention_backends)}; "
                             f"got {self.attention_backend!r}")
        from pagedllm.layers.attention.kv_quant import CHOICES as kv_cache_dtypes

        if self.kv_cache_dtype not in kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(kv_cache_dtypes)}; got "
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
            from pagedllm.platforms.cpu.threads import resolve_num_threads
            from pagedllm.worker.kv_cache_budget import cpu_kv_cache_space_bytes

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
            max_logprobs=self.max_logprobs,
            runner=self.runner,
        )
        return EngineConfig(
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
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           pipeline_parallel_size=self.pipeline_parallel_size,
                                           nnodes=self.nnodes, node_rank=self.node_rank,
                                           master_addr=self.master_addr, master_port=self.master_port,
                                           distributed_executor_backend=self.distributed_executor_backend,
                                           num_threads=threads, num_threads_reason=threads_reason),
            device=device,
        )
