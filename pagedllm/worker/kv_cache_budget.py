"""How many KV blocks fit: the memory budget less weights and the profiled activation peak.

CUDA: ``gpu_memory_utilization`` x device memory, less the peak memory PyTorch allocated during a
profile forward pass at ``max_num_batched_tokens`` (which includes the weights), less memory held
by other processes. CPU: ``gpu_memory_utilization`` x physical RAM, less this process's resident
memory after the profile pass (weights, libraries, activation peak). ``kv_cache_memory`` (bytes)
overrides both. On a CPU the cache is also capped at what ``max_num_seqs`` full-length sequences
can use, since every block is committed memory there.

CPU default: when neither ``kv_cache_memory`` nor ``gpu_memory_utilization`` is given, a fixed size
(4 GiB, or ``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB; vLLM's CPU backend does the same with
``VLLM_CPU_KVCACHE_SPACE``) instead of a share of RAM, which a laptop also needs for everything else.
No profile pass is needed then, which also shortens start-up.
"""
from __future__ import annotations

import os
import resource
from typing import Callable

import torch

from pagedllm import envs


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


CPU_KVCACHE_SPACE_ENV = "PAGEDLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0


def cpu_kv_cache_space_bytes() -> tuple[int, str]:
    """(default KV-cache bytes per rank on a CPU, why): ``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB or 4 GiB,
    at most half the physical RAM.

    Raises:
        ValueError: the environment variable is not a positive number.
    """
    gib = envs.PAGEDLLM_CPU_KVCACHE_SPACE  # None when unset; raises ValueError when not a positive number
    if gib is not None:
        how = f"{CPU_KVCACHE_SPACE_ENV}={envs.raw(CPU_KVCACHE_SPACE_ENV).strip()} GiB"  # as the user wrote it
    else:
        gib = DEFAULT_CPU_KVCACHE_SPACE_GIB
        how = (f"CPU default {gib:g} GiB (set --kv-cache-memory, --gpu-memory-utilization or "
               f"{CPU_KVCACHE_SPACE_ENV} to change)")
    space = int(gib * 2**30)
    half_ram = physical_memory_bytes() // 2
    if space > half_ram:
        space, how = half_ram, f"{how}, capped at half of {physical_memory_bytes() / 2**30:.1f} GiB RAM"
    return space, how


def kv_cache_budget_bytes(device: str, utilization: float, kv_cache_memory: int | None,
                          profile_run: Callable[[], None], cpu_kv_cache_space: int | None = None,
                          cpu_kv_cache_space_reason: str = "") -> tuple[int, str]:
    """(bytes available for the KV cache on this rank, how it was derived for the log).
    ``cpu_kv_cache_space``: the fixed CPU default (see ``cpu_kv_cache_space_bytes``); when set on a
    CPU it is the budget and no profile pass runs."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory), "kv_cache_memory"
    if cpu_kv_cache_space is not None and not device.startswith("cuda"):
        return int(cpu_kv_cache_space), cpu_kv_cache_space_reason or "CPU default"
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
