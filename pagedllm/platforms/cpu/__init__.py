"""The CPU wing: everything only the CPU path needs.

- ``build.py``: compiles this folder's C++ sources with the host's compiler into a cache, on first use.
- ``ops.py``: this wing's bodies for the ops layers call (``platforms/ops.py``), over the kernels below.
- ``fused_ops.py`` (``fused_ops.cpp``): residual add + RMSNorm, RoPE, SiLU/GELU-tanh * up, the sampler's passes.
- ``float_gemm.py`` (``float_gemm.cpp``), ``int8_gemm.py`` (``int8_gemm.cpp``), ``panel_gemm.h``: packed GEMMs.
- ``attention.py`` (``paged_attention.cpp``, ``paged_attention_simd.h``): the paged-attention kernels.
- ``layer_runner.py`` (``layer_runner.cpp``): all decoder layers of a step in one C call.
- ``lora_ops.py`` (``lora_ops.cpp``): the batched LoRA shrink/expand the layer runner calls after each target linear.
- ``threads.py``, ``malloc.py``: intra-op threads and glibc malloc tuning for this process.
- ``cpu_math.h``: the vector helpers the C++ sources share.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.platforms.cpu import layer_runner, malloc
from pagedllm.platforms.cpu.ops import CpuOps
from pagedllm.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    ops = CpuOps

    def prepare_process(self) -> None:
        malloc.keep_freed_memory()  # activations reuse freed pages (malloc.py)

    def release_load_memory(self) -> None:
        malloc.release_freed_memory()  # what loading freed, kept by those settings (malloc.py)

    # ---- the fused layer stack (layer_runner.py) ----
    def layer_stack(self, model: Any, lora: Optional[Any] = None) -> Optional[Callable]:
        """The callable the model runner sets as ``model.layer_stack`` (which the model's forward calls
        in place of its layer loop): all decoder layers of a step in one C call where the runner covers
        the model and the step, else None from the call (the loop runs). Whether it applies is decided,
        and logged, on its first call. ``lora``: the LoRA runtime (--enable-lora) whose adapters it adds."""
        return layer_runner.layer_stack(model, lora)
