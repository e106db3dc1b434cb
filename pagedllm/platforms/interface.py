"""What a platform supplies to the rest of pagedllm: its device type, its default attention backend,
and the fast bodies of the ops that layers call (``pagedllm/platforms/ops.py``, the seam).

One ``Platform`` subclass per wing (``platforms/cpu/``, ``platforms/cuda/``); ``platforms/__init__.py``
picks one, once, as ``current_platform`` (vLLM's ``vllm.platforms.current_platform``). Its ``ops`` is a
``PlatformOps`` subclass: the seam calls ``current_platform.ops.<name>`` and runs its own native torch
body wherever that returns None.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class PlatformOps:
    """A platform's fast bodies for the ops of ``platforms/ops.py``, as static methods of the same
    names (the seam documents each: shapes, dtypes, what is in place). Each returns None (the
    in-place ones: False) where it does not apply: another device or dtype, a layout its kernel
    does not take, its library not built, its switch off. The seam then runs the native body, so
    a platform overrides only what it has a kernel for. This base applies nowhere.

    Hot path: the norms, activations and RoPE run hundreds of times per decode step, so a body
    tests its preconditions with a few attribute reads before its kernel call and nothing more.
    """

    # -- norms, activations, RoPE, sampling (``platforms/ops.py`` gives the semantics)
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> bool:
        return False

    @staticmethod
    def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def gemma_add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            next_weight: Optional[torch.Tensor] = None,
                            next_eps: float = 0.0) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def gelu_tanh_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> bool:
        return False

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    # -- float linear layers: the platform's packed weights
    @staticmethod
    def pack_gemm_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def gemm_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                    n: int) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def pack_library_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def library_linear(x: torch.Tensor, packed: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None

    # -- W8A8 int8 linear layers
    @staticmethod
    def quantize_per_token(x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return None

    @staticmethod
    def int8_mm(a: torch.Tensor, b: torch.Tensor, b_row_sums: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                      dtype: torch.dtype) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_pack_panels(w: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_unpack_panels(packed: torch.Tensor, n: int, k: int) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_panel_gemm(a: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_panel_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None

    @staticmethod
    def int8_panels_only() -> bool:
        return False

    # -- GGUF weights kept in their ggml blocks
    @staticmethod
    def gguf_kernel_types() -> tuple[frozenset, str]:
        return frozenset(), "no GGUF kernels on this platform"

    @staticmethod
    def gguf_linear(x: torch.Tensor, segments: list, n: int) -> Optional[torch.Tensor]:
        return None

    # -- mixture of experts
    @staticmethod
    def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        return False


class Platform:
    """A device family. Subclasses set the class attributes; nothing here probes hardware at import."""

    name: str = "native"
    device_type: str = "cpu"  # the torch device type of the engine's tensors
    ops: type[PlatformOps] = PlatformOps  # the fast op bodies (a class: its static methods, no instance)

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def prepare_process(self) -> None:
        """Tune this process for the platform's kernels before a model loads (the CPU wing: glibc malloc)."""

    def release_load_memory(self) -> None:
        """After a model loaded: give back the memory its loading freed (the CPU wing: glibc's heap)."""

    def layer_stack(self, model: Any, lora: Optional[Any] = None) -> Optional[Callable]:
        """A fused stack of ``model``'s decoder layers, set as ``model.layer_stack`` by the model
        runner (the model's forward calls it in place of its layer loop); None: the loop runs.
        ``lora`` (--enable-lora): the ``LoRARuntime`` whose adapters the stack must add to the steps
        with adapter tokens (``lora.ctx.step``), or return None for those steps (the loop's hooks do)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
