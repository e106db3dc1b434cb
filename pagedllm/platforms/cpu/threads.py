"""How many CPU threads the engine's matmuls and kernels use (torch intra-op threads).

Default: the physical cores this process may run on. Hyper-threads share one core's vector units,
so a second thread per core adds contention rather than FLOPs for GEMM-bound work (vLLM's CPU
backend and llama.cpp also default to physical cores). ``OMP_NUM_THREADS``, when set, wins over
that default; ``num_threads`` (``--num-threads``) wins over both.
"""
from __future__ import annotations

import ctypes
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


_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all``, OpenMP 5.0).

    Call it from the thread that loaded the model before another thread (the server's engine
    loop) runs the forward passes. Each thread that opens a parallel region keeps its own pool of
    ``threads - 1`` workers, and GNU libgomp lets a waiting worker spin only while the process
    has no more OpenMP threads than CPUs: past that, every parallel region ends in a futex sleep
    and the next one begins with a wake-up. With the default threads = cores, the loader's idle
    pool was that one thread too many, and SmolLM2's decode steps ran 1.6x slower in a second
    thread than in the first. A pool is made again if this thread opens a parallel region later.

    Returns True when an OpenMP runtime was found in the process and released its threads.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:  # not Linux
        return False
    for path in sorted(paths):
        # libgomp.so.1, or a wheel's renamed copy such as libgomp-a34b3233.so.1
        if os.path.basename(path).split(".so")[0].split("-")[0] in ("libgomp", "libiomp5", "libomp"):
            try:
                return ctypes.CDLL(path).omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
            except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
                return False
    return False

