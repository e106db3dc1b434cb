"""Compile a C++ source of this package into a shared library on first use and load it with ctypes.

The CPU kernels (``platforms/cpu/paged_attention.cpp``, ``platforms/cpu/fused_ops.cpp``) use
no torch headers, so they need neither ninja nor torch as a build requirement: the host's C++
compiler (``$CXX`` or g++) builds them in a second or two into ``$PAGEDLLM_CACHE_DIR`` (default
``~/.cache/pagedllm/kernels``), keyed by the source, the shared headers (``cpu_math.h``), the
headers beside the source, the flags and the CPU's flags.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from pagedllm import envs

BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
INCLUDE_DIR = Path(__file__).parent  # cpu_math.h, shared by the kernels

logger = logging.getLogger("pagedllm")


def cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_library(source: Path, flags: list[str]) -> ctypes.CDLL:
    """Compile ``source`` with ``flags`` (cached) and load it.

    Raises:
        RuntimeError: no compiler, or the compiler failed (its last lines of stderr).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    flags = [*flags, f"-I{INCLUDE_DIR}"]
    headers = sorted({*INCLUDE_DIR.glob("*.h"), *source.parent.glob("*.h")})  # shared, and the source's own
    src = source.read_bytes() + b"".join(h.read_bytes() for h in headers)
    key = hashlib.sha256(src + " ".join([cxx, *flags]).encode() + cpu_id().encode()).hexdigest()[:16]
    cache = envs.PAGEDLLM_CACHE_DIR / "kernels"
    lib_path = cache / f"{source.stem}-{key}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # A first build takes seconds (a minute on a loaded host) with nothing else printed: say what runs.
        logger.info("compiling the CPU kernel %s with %s (first use on this CPU and compiler; "
                    "cached as %s for later runs)", source.name, Path(cxx).name, lib_path)
        t0 = time.perf_counter()
        # Build to a private name, then rename: concurrent builders (tensor-parallel ranks) are safe.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-400:]}")
            os.replace(tmp, lib_path)
            logger.debug("compiled %s in %.1f s", source.name, time.perf_counter() - t0)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(lib_path))


class LazyLibrary:
    """A library built and loaded once per process on first ``get()``; ``get()`` -> (library, None),
    or (None, why not) when it could not be built or loaded (the reason is kept, not raised)."""

    def __init__(self, build: Callable[[], ctypes.CDLL]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self.lib: Optional[ctypes.CDLL] = None
        self.error: Optional[str] = None

    def get(self) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
        lib = self.lib
        if lib is not None:  # built: no lock (called per layer and op)
            return lib, None
        with self._lock:
            if self.lib is None and self.error is None:
                try:
                    self.lib = self._build()
                except Exception as e:  # noqa: BLE001 - any failure becomes the fallback's reason
                    self.error = f"{type(e).__name__}: {e}"
            return self.lib, self.error
