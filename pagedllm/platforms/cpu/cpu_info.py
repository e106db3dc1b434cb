"""What this CPU can do for bf16: does it multiply bf16 matrices natively, and does our GEMM take bf16 here?

``--dtype auto`` on a CPU asks these (``pagedllm.engine.arg_utils.resolve_dtype``), as does ``pagedllm bench matmul``.
"""
from __future__ import annotations

from pagedllm.platforms.cpu import float_gemm


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
    """Whether ``float_gemm`` has a bf16 GEMM on this CPU (AVX512-BF16, or AVX2 widening bf16 to
    float32; builds the library on first use, as loading a model would)."""
    lib, _ = float_gemm._LIBRARY.get()
    return lib is not None and lib.float_gemm_level() >= 2
