"""platforms/cpu/malloc.py: with the settings applied, a large tensor freed and allocated again reuses
its pages (no new page faults); without them (the switch off) glibc maps fresh pages each time."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="glibc mallopt settings: Linux with glibc only")

# 64 MiB: above glibc's largest adaptive mmap threshold (32 MiB), so plain glibc mmaps it every time.
CHILD = r"""
import resource, torch
from pagedllm.platforms.cpu import malloc as cpu_malloc
applied = cpu_malloc.keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):  # warm-up: the first allocations grow the heap
    x = torch.empty(16 << 20).fill_(1.0); del x
f0 = faults()
for _ in range(5):
    x = torch.empty(16 << 20).fill_(1.0); del x
print(applied, faults() - f0)
"""


def run_child(switch: str) -> tuple[bool, int]:
    env = dict(os.environ, PAGEDLLM_CPU_MALLOC_TUNING=switch, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def test_freed_activation_memory_is_reused():
    applied, faults = run_child("1")
    assert applied
    # 5 x 16,384 pages without the settings; with them at most one of the five (glibc moved the
    # heap top once in about ten CI runs) comes in fresh
    assert faults < 16384 + 1000


def test_switch_off_leaves_glibc_defaults():
    applied, faults = run_child("0")
    assert not applied
    assert faults >= 5 * 16384 * 0.9  # every 64 MiB allocation is a fresh mapping


ENGINE_CHILD = r"""
import sys
from pagedllm import LLM, SamplingParams
from pagedllm.platforms.cpu import malloc as cpu_malloc
assert not cpu_malloc._applied
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory=1 << 20)
llm.generate(["hello"], SamplingParams(max_tokens=2))
print(cpu_malloc._applied)
"""


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_cpu_engine_applies_the_settings_unless_switched_off(llama_dir, switch):
    env = dict(os.environ, PAGEDLLM_CPU_MALLOC_TUNING=switch)
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, llama_dir], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split()[-1] == ("True" if switch == "1" else "False")


RELEASE_CHILD = r"""
import torch
from pagedllm.platforms.cpu import malloc as cpu_malloc
assert cpu_malloc.keep_freed_memory()
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) // 1024
x = [torch.empty(4 << 20).fill_(1.0) for _ in range(24)]  # 24 x 16 MiB, on the heap under the settings
before = rss_mib()
del x
kept = rss_mib()
released = cpu_malloc.release_freed_memory()
print(released, before - kept, before - rss_mib())
"""


def test_release_freed_memory_gives_back_what_the_settings_keep():
    """A load's transients freed under the settings stay resident until ``release_freed_memory``
    (the model runner calls it once, after loading) hands them back."""
    env = dict(os.environ, PAGEDLLM_CPU_MALLOC_TUNING="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], env=env, capture_output=True, text=True, check=True)
    released, dropped_on_free, dropped_on_release = out.stdout.split()
    assert released == "True"
    assert int(dropped_on_free) < 100  # of 384 MiB: kept
    assert int(dropped_on_release) > 300
