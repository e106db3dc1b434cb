"""How many CPU threads the engine's matmuls and kernels use (torch intra-op threads).

Default: the physical cores this process may run on. Hyper-threads share one core's vector units,
so a second thread per core adds contention rather than FLOPs for GEMM-bound work (vLLM's CPU
backend and llama.cpp also default to physical cores). ``OMP_NUM_THREADS``, when set, wins over
that default; ``num_threads`` (``--num-threads``) wins over both.
"""
from __future__ import annotations

import os


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may use (Linux sysfs); the
    logical CPU count where the topology is not readable."""
    cpus = _allowed_cpus()
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                pkg = f.read().strip()
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((pkg, core))
    return max(1, len(cores))


def resolve_num_threads(num_threads: int | None) -> tuple[int, str]:
    """(threads, why) for the start-up log. Raises ValueError for a count below 1."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        return num_threads, "--num-threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "OMP_NUM_THREADS"
    n = physical_cores()
    return n, f"physical cores ({len(_allowed_cpus())} logical CPUs available)"
