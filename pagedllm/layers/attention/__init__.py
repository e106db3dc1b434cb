"""Paged attention: the shared per-step metadata, the backend interface, the backends (the torch
reference, a compiled CPU kernel) and the selector behind ``--attention-backend``."""
from pagedllm.layers.attention.backend import AttentionBackend, write_kv
from pagedllm.layers.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.layers.attention.selector import ATTENTION_BACKENDS, get_attention_backend
from pagedllm.layers.attention.torch_backend import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSeq", "TorchPagedAttention", "ATTENTION_BACKENDS",
           "get_attention_backend", "write_kv"]
