"""The CUDA wing: everything only NVIDIA GPUs need (Triton kernels, the CUDA-graph runner, optional
flash-attn / flashinfer backends land here). Today CUDA runs the native torch ops and the torch
reference attention backend."""
from __future__ import annotations

from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
