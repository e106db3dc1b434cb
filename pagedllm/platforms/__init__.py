"""The one place that decides the platform: ``current_platform`` is the CUDA wing where torch sees a
GPU, else the CPU wing (vLLM's ``current_platform``). Decided once, on first use.

Everything only one platform needs lives in its wing (``platforms/cpu/``, ``platforms/cuda/``);
layers call the ops of ``platforms/ops.py`` and never test the device themselves.
"""
from __future__ import annotations

import functools

import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.platforms.interface import Platform


@functools.lru_cache(maxsize=None)
def _resolve() -> Platform:
    return CudaPlatform() if torch.cuda.is_available() else CpuPlatform()


def __getattr__(name: str):
    if name == "current_platform":  # on first use, not at import: asking torch for CUDA can wait
        return _resolve()
    raise AttributeError(name)


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "current_platform"]
