"""How many KV blocks fit: the memory budget less weights and the profiled activation peak.

CUDA: ``gpu_memory_utilization`` x device memory, less the peak memory PyTorch allocated during a
profile forward pass at ``max_num_batched_tokens`` (which includes the weights), less memory held
by other processes. CPU: ``gpu_memory_utilization`` x physical RAM, less this process's resident
memory after the profile pass (weights, libraries, activation peak). ``kv_cache_memory`` (bytes)
overrides both. On a CPU the cache is also capped at what ``max_num_seqs`` full-length sequences
can use, since every block is committed memory there.
"""
from __future__ import annotations

import os
import resource
from typing import Callable

import torch


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def kv_cache_budget_bytes(device: str, utilization: float, kv_cache_memory: int | None,
                          profile_run: Callable[[], None]) -> tuple[int, str]:
    """(bytes available for the KV cache on this rank, how it was derived for the log)."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory), "kv_cache_memory"
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free_before, total = torch.cuda.mem_get_info()
        others = total - free_before - torch.cuda.memory_reserved()
        profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        budget = int(total * utilization) - peak - max(0, others)
        return budget, f"{utilization:.2f} x {total / 2**30:.1f} GiB - {peak / 2**30:.2f} GiB peak"
    profile_run()
    total = physical_memory_bytes()
    used = peak_rss_bytes()
    budget = int(total * utilization) - used
    return budget, f"{utilization:.2f} x {total / 2**30:.1f} GiB RAM - {used / 2**30:.2f} GiB in use"
