"""Shared pieces of every bench: result files (JSON + PNG), run metadata, percentiles, sizes."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from importlib.metadata import version
from typing import Any, Callable, Iterable, Optional

import torch


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """'268435456', '256MiB', '1.5GiB', '300MB' -> bytes. Raises ValueError."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abgikm")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r} (e.g. 268435456, 256MiB, 1GiB)")
    return int(float(num) * _UNITS[unit])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (like numpy's default); NaN for an empty list."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(values: Iterable[Optional[float]], scale: float = 1.0) -> dict[str, float]:
    """mean / median / p99 / min / max (times ``scale``, e.g. 1000 for ms) of the non-None values."""
    vals = [x * scale for x in values if x is not None]
    if not vals:
        return {"count": 0, "mean": float("nan"), "median": float("nan"), "p99": float("nan"),
                "min": float("nan"), "max": float("nan")}
    return {"count": len(vals), "mean": sum(vals) / len(vals), "median": percentile(vals, 50),
            "p99": percentile(vals, 99), "min": min(vals), "max": max(vals)}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(mod: str) -> Optional[str]:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - a missing optional package is just reported as None
        return None


def run_metadata() -> dict[str, Any]:
    """Command line, package versions and the machine, recorded in every result file."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = None
    try:
        pagedllm_version = version("pagedllm")
    except Exception:  # noqa: BLE001
        pagedllm_version = None
    return {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "argv": list(sys.argv),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"pagedllm": pagedllm_version, "torch": torch.__version__,
                     "transformers": _version("transformers"), "python": platform.python_version()},
        "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "ram_bytes": ram,
                    "torch_num_threads": torch.get_num_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "platform": platform.platform(),
                    "loadavg_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def on_off_ratios(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    """How much a feature helps, from two runs' results (``ttft_ms`` summaries, ``total_throughput_tok_s``):
    mean TTFT off / on and throughput on / off."""
    return {"ttft_speedup_mean": off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"],
            "throughput_ratio": on["total_throughput_tok_s"] / off["total_throughput_tok_s"]}


def describe_on_off(feature: str, off: dict[str, Any], on: dict[str, Any], ratios: dict[str, float],
                    extra: str = "") -> str:
    """One line: mean TTFT and throughput of both runs, the ratios, ``extra`` at the end."""
    return (f"{feature} off: TTFT mean {off['ttft_ms']['mean']:.0f} ms, {off['total_throughput_tok_s']:.1f} tok/s | "
            f"on: TTFT mean {on['ttft_ms']['mean']:.0f} ms, {on['total_throughput_tok_s']:.1f} tok/s | "
            f"TTFT {ratios['ttft_speedup_mean']:.2f}x faster, throughput {ratios['throughput_ratio']:.2f}x{extra}")


def write_result(output_dir: str, name: str, result: dict[str, Any], fig=None) -> tuple[str, Optional[str]]:
    """Write ``<name>.json`` (and ``<name>.png`` from a matplotlib figure) into ``output_dir``.
    Returns (json path, png path or None)."""
    os.makedirs(output_dir, exist_ok=True)
    base, n = name, 1
    while os.path.exists(os.path.join(output_dir, f"{name}.json")):  # two runs in the same second
        name, n = f"{base}-{n}", n + 1
    json_path = os.path.join(output_dir, f"{name}.json")
    png_path = None
    if fig is not None:
        png_path = os.path.join(output_dir, f"{name}.png")
        fig.savefig(png_path, dpi=90, bbox_inches="tight")
        import matplotlib.pyplot as plt  # lazily: matplotlib is optional (pagedllm[bench])

        plt.close(fig)
        result = {**result, "plot": png_path}
    with open(json_path, "w") as f:
        json.dump(_clean(result), f, indent=1)
    print(f"result written to {json_path}" + (f" and {png_path}" if png_path else ""))
    return json_path, png_path


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display needed), or None (with a warning) when
    matplotlib is not installed: the JSON result is still written."""
    try:
        import matplotlib  # lazily: matplotlib is optional (pagedllm[bench])
    except ImportError:
        print("matplotlib is not installed (pip install 'pagedllm[bench]'): no plot written")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazily: matplotlib is optional (pagedllm[bench])

    return plt


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


# The parts of an engine step the benches time (bench profile, bench overhead), by part name.
ENGINE_PARTS = ("schedule", "update_requests", "prepare_inputs", "sample", "detokenize", "make_outputs", "forward")


def wrap_engine_parts(engine, wrap: Callable[[str, Callable], Callable], labels: Optional[dict] = None) -> None:
    """Replace each part of ``engine``'s step (``ENGINE_PARTS``) by ``wrap(label, part)``: the label is
    ``labels.get(part, part)`` (two parts may share one). No engine file changes: the parts are instance
    attributes (``prepare_inputs``: the persistent batch's ``prepare``)."""
    labels = labels or {}
    sched, op = engine.scheduler, engine.output_processor
    owners = {"schedule": (sched, "schedule"), "update_requests": (sched, "update_from_output"),
              "prepare_inputs": ((engine.input_batch, "prepare") if hasattr(engine, "input_batch")  # (older
                                 else (sys.modules[type(engine).__module__], "prepare_inputs")),  # trees)
              "sample": (engine, "sampler"),
              "detokenize": (op, "process"), "make_outputs": (op, "make_output"),
              "forward": (engine.executor, "execute_model")}
    for part in ENGINE_PARTS:
        owner, attr = owners[part]
        setattr(owner, attr, wrap(labels.get(part, part), getattr(owner, attr)))

