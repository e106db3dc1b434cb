"""The resolved engine settings every layer reads: ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
``ParallelConfig``, bundled in ``EngineConfig``; plain data, built once by
``pagedllm.engine.arg_utils.EngineArgs.create_engine_config()`` from what the user set.

A leaf: it imports only the standard library and torch, so any module may read it. Also here: the
dtype names the settings accept (``DTYPE_NAMES``), the bundled demo model's path and ``get_rope_parameters``,
RoPE settings read the same way from transformers 4.x and 5.x configs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

DEMO_MODEL_PATH = str(Path(__file__).parent / "assets" / "shakespeare-llama")

# dtype names the settings accept (``--dtype``, ``PAGEDLLM_CPU_AUTO_DTYPE``, a checkpoint's ``torch_dtype``)
DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


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


# Tokens per KV-cache block unless --block-size says otherwise (vLLM's default): the one place it is written.
DEFAULT_BLOCK_SIZE = 16

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
    enforce_eager: bool = False  # no CUDA graphs of decode steps (platforms/cuda/graph_runner.py)
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    # "generate" (sample tokens) or "pooling" (embeddings: each prompt's last hidden state, normalized;
    # vLLM's --runner pooling); see layers/pooler.py
    runner: str = "generate"
    # LoRA adapters are served (--enable-lora): the loader then leaves SmoothQuant out, whose factors,
    # folded into the norms and weights, would change the inputs the adapters' A matrices were trained on.
    lora_enabled: bool = False
    # Image inputs (multimodal/): the most images one prompt may carry ({"image": N}; None: the
    # family's default, vLLM's --limit-mm-per-prompt), the folder file:// URLs may name (None: none),
    # whether http(s) image URLs are fetched.
    limit_mm_per_prompt: Optional[dict] = None
    allowed_local_media_path: Optional[str] = None
    allow_remote_media: bool = False

    @property
    def multimodal_config(self) -> Any:
        """The whole config of an image-text checkpoint whose vision tower is served (its vision tower
        is built from it; ``models/checkpoint.py``), else None (text only)."""
        return getattr(self.hf_config, "multimodal_config", None)

    @property
    def is_multimodal(self) -> bool:
        return self.multimodal_config is not None

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
    block_size: int = DEFAULT_BLOCK_SIZE
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
    max_loras: int = 0  # adapters one step may use (--max-loras under --enable-lora); 0: LoRA off


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
class LoRAConfig:
    """--enable-lora (pagedllm/lora/): adapters in one step (slots), their largest rank, adapters cached
    in CPU memory, and the batched op's grouping (lora/ops.py: grouped, bmm or auto)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    op_mode: str = "auto"


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``; parsed and checked by
    ``pagedllm/spec_decode/config.py``). ``method``: "ngram" (prompt lookup) or "draft_model";
    ``num_speculative_tokens``: k proposals a sequence a step; ``prompt_lookup_min/max``: n-gram
    lengths matched (ngram); ``draft_model_config``: the draft's ``ModelConfig`` (draft_model);
    ``disable_by_batch_size``: no proposals in a step with more running sequences than this (None: never)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Optional[str] = None
    draft_model_config: Optional[ModelConfig] = None
    draft_quantization: Optional[str] = None  # the draft's --quantization (None: as its checkpoint is)
    disable_by_batch_size: Optional[int] = None


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str
    lora_config: Optional[LoRAConfig] = None  # None: LoRA off
    speculative_config: Optional[SpeculativeConfig] = None
