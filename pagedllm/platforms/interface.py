"""What a platform supplies to the rest of pagedllm: its device type, its default attention backend,
and the per-platform bodies of the ops that layers call (``pagedllm/platforms/ops.py``).

One ``Platform`` subclass per wing (``platforms/cpu/``, ``platforms/cuda/``); ``platforms/__init__.py``
picks one, once, as ``current_platform`` (vLLM's ``vllm.platforms.current_platform``).
"""
from __future__ import annotations


class Platform:
    """A device family. Subclasses set the class attributes; nothing here probes hardware at import."""

    name: str = "native"
    device_type: str = "cpu"  # the torch device type of the engine's tensors

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
