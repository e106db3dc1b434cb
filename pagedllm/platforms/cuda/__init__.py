"""The CUDA wing: everything only NVIDIA GPUs need (Triton kernels, the CUDA-graph runner, optional
flash-attn / flashinfer backends land here). Today CUDA tensors run our Triton kernels for the
elementwise ops (``triton_ops.py``: norms, activations, RoPE) and otherwise the native torch ops of
``platforms/ops.py`` (``ops.py``: the int8 matmul's cuBLASLt detours), and the torch reference
attention backend."""
from __future__ import annotations

from pagedllm.platforms.cuda.ops import CudaOps
from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    ops = CudaOps
