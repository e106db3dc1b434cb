"""Attention backends by name (``--attention-backend``), vLLM-style: ``auto`` takes the first
backend in the device type's ``AUTO_ORDER`` that supports the setup and logs one line saying which and
why; a backend named explicitly must support it, else ValueError with its reason."""
from __future__ import annotations

import importlib
import logging

import torch

from pagedllm.layers.attention.backend import AttentionBackend

logger = logging.getLogger("pagedllm")

# name -> "module:class", imported on first use (a backend may need a compiler or a library).
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "pagedllm.layers.attention.torch_backend:TorchPagedAttention",
    "cpu": "pagedllm.layers.attention.cpu_backend:CpuPagedAttention",
    "triton": "pagedllm.layers.attention.triton_backend:TritonPagedAttention",
    "flash-attn": "pagedllm.layers.attention.flash_attn_backend:FlashAttnPagedAttention",
    "flashinfer": "pagedllm.layers.attention.flashinfer_backend:FlashInferPagedAttention",
}
# device type -> the order ``auto`` tries (others: DEFAULT_AUTO_ORDER). Triton only on CUDA: on a CPU its
# interpreter (TRITON_INTERPRET=1) is for tests, and a CPU's log line names only the backends it tries.
AUTO_ORDER: dict[str, list[str]] = {"cuda": ["triton", "torch"]}
DEFAULT_AUTO_ORDER: list[str] = ["cpu", "torch"]
CHOICES = ["auto", *ATTENTION_BACKENDS]


def backend_class(name: str) -> type[AttentionBackend]:
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str, *, device: str, dtype: torch.dtype, head_dim: int,
                          block_size: int) -> AttentionBackend:
    """An instance of backend ``name`` ("auto" or a key of ``ATTENTION_BACKENDS``) for this setup.

    Raises:
        ValueError: unknown name, or the named backend does not support the setup (says why).
    """
    setup = dict(device=device, dtype=dtype, head_dim=head_dim, block_size=block_size)
    if name == "auto":
        refused = []
        for cand in AUTO_ORDER.get(torch.device(device).type, DEFAULT_AUTO_ORDER):
            reason = backend_class(cand).unsupported_reason(**setup)
            if reason is None:
                why = f" ({'; '.join(refused)})" if refused else ""
                logger.info("attention backend: %s%s", cand, why)
                return backend_class(cand)()
            refused.append(f"{cand}: {reason}")
        raise ValueError(f"no attention backend supports this setup: {'; '.join(refused)}")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(CHOICES)}; got {name!r}")
    reason = backend_class(name).unsupported_reason(**setup)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run this setup: {reason}")
    return backend_class(name)()
