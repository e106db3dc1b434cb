"""Paged attention on the GPU through our own Triton kernels (``platforms/cuda/triton_attention.py``):
K/V written by slot mapping and read in place through the block table, flash-decoding for decodes and
one varlen causal kernel for prefills and prefill chunks over a cached prefix.

``--attention-backend triton``; ``auto`` picks it on CUDA when triton imports (``selector.py``). Triton is
an optional dependency (the ``[cuda]``/``[test]`` extras): it is imported only when this backend is asked
about or used. With ``TRITON_INTERPRET=1`` (Triton's own switch, set before the kernels are imported) the
same kernels run on CPU tensors through Triton's interpreter: slow, for tests only.
"""
from __future__ import annotations

import functools
import os

import torch

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.torch_backend import TorchPagedAttention

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # (= the kernels' SUPPORTED_DTYPES)
MAX_HEAD_DIM = 576  # (= the kernels' MAX_HEAD_DIM: MLA's 512 + 64)


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET``, read as Triton reads it: 1/true/yes/on/y)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


@functools.lru_cache(maxsize=1)
def _triton_error():
    """None when triton imports, else the error's text (the kernels themselves are imported at first use:
    Triton fixes interpreted or compiled when they are defined)."""
    try:
        # lazily: triton is an optional dependency (the [cuda]/[test] extras)
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a triton that fails to initialize
        return f"{type(e).__name__}: {e}"
    return None


def _kernels():
    """The kernel module (platforms/cuda/triton_attention.py)."""
    # lazily: it imports triton, an optional dependency (the [cuda]/[test] extras)
    from pagedllm.platforms.cuda import triton_attention
    return triton_attention


class TritonPagedAttention(AttentionBackend):
    """Our Triton kernels for CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``) in fp16/bf16/fp32,
    caches in that dtype or int8, head_dim 1..576, any block size; sliding window, soft-cap, sinks and
    Llama 4's attention_chunk, a one-plane cache (MLA's latent). The KV-cache-less profiling pass runs
    on the torch reference.

    ``decode_split``: decodes by flash-decoding (the context split over programs, then a reduction
    kernel); False sends them through the prefill kernel (tests check both paths)."""

    name = "triton"
    needs_zeroed_cache = False  # reads only positions < seq_len, all written
    decode_split = True

    def __init__(self) -> None:
        self._reference = TorchPagedAttention()

    @classmethod
    def unsupported_reason(cls, *, device, dtype, head_dim, block_size):
        if not str(device).startswith("cuda") and not interpreting():
            return (f"the kernels run on CUDA tensors only (device is {device}; TRITON_INTERPRET=1 runs them "
                    f"on the CPU through Triton's interpreter)")
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not float16, bfloat16 or float32"
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM}"
        if block_size < 1:
            return f"block_size {block_size} is not positive"
        err = _triton_error()
        return None if err is None else f"triton does not import ({err})"

    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None, sinks=None,
                attention_chunk=None):
        if kv_cache is None or meta.block_tables is None:
            return self._reference.forward(q, k, v, kv_cache, meta, scale, sliding_window=sliding_window,
                                           logits_soft_cap=logits_soft_cap, sinks=sinks,
                                           attention_chunk=attention_chunk)
        kernels = _kernels()
        kernels.write_kv(k, v, kv_cache, meta.slot_mapping, meta.block_size)
        return kernels.paged_attention(q, kv_cache, meta, scale, sliding_window=sliding_window,
                                       logits_soft_cap=logits_soft_cap, sinks=sinks,
                                       attention_chunk=attention_chunk, decode_split=self.decode_split)

