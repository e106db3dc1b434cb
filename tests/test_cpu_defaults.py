"""CPU defaults: the dtype ``auto`` picks, the fixed-size KV cache, the thread count, and the start-up
line that explains them."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import pagedllm.engine.arg_utils as config_mod
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs, resolve_dtype
from pagedllm.platforms.cpu import threads as cpu_threads
from pagedllm.worker.kv_cache_budget import cpu_kv_cache_space_bytes, physical_memory_bytes

from conftest import assert_pool_empty, build_checkpoint


class _Cfg:
    dtype = "bfloat16"


@pytest.mark.parametrize("native, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native, want):
    monkeypatch.delenv("PAGEDLLM_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: native)
    dtype, why = resolve_dtype("auto", _Cfg(), "cpu")
    assert dtype == want and why.startswith("auto: this CPU has") == native
    # without native bf16 the start-up line points at --dtype bfloat16 where our GEMM takes it
    assert ("--dtype bfloat16" in why) == (not native and config_mod.cpu_bf16_gemm())
    assert resolve_dtype("float32", _Cfg(), "cpu") == (torch.float32, "given")
    assert resolve_dtype("auto", _Cfg(), "cuda")[0] == torch.bfloat16  # CUDA: the checkpoint's dtype


def test_auto_dtype_env_override_and_errors(monkeypatch):
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv("PAGEDLLM_CPU_AUTO_DTYPE", "float32")
    assert resolve_dtype("auto", _Cfg(), "cpu")[0] == torch.float32
    monkeypatch.setenv("PAGEDLLM_CPU_AUTO_DTYPE", "int3")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_AUTO_DTYPE"):
        resolve_dtype("auto", _Cfg(), "cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8", _Cfg(), "cpu")


def test_cpu_bf16_flag_matches_proc_cpuinfo():
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags on this platform")
    assert config_mod.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_kv_cache_space_default_env_and_errors(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    space, why = cpu_kv_cache_space_bytes()
    assert space == min(4 * 2**30, physical_memory_bytes() // 2) and "4 GiB" in why
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.5")
    assert cpu_kv_cache_space_bytes()[0] == 2**29
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "1e9")
    assert cpu_kv_cache_space_bytes()[0] == physical_memory_bytes() // 2
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE"):
            cpu_kv_cache_space_bytes()


def test_fixed_kv_space_only_when_no_memory_setting_given(llama_dir, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    cc = EngineArgs(model=llama_dir, device="cpu").create_engine_config().cache_config
    assert cc.cpu_kv_cache_space == min(4 * 2**30, physical_memory_bytes() // 2)
    for kw in ({"gpu_memory_utilization": 0.5}, {"kv_cache_memory": 2**20}):
        cc = EngineArgs(model=llama_dir, device="cpu", **kw).create_engine_config().cache_config
        assert cc.cpu_kv_cache_space is None
    assert EngineArgs(model=llama_dir, device="cpu").create_engine_config().cache_config.gpu_memory_utilization == 0.9


def test_cpu_step_token_budget_default(tmp_path):
    """2,048 tokens a step on a CPU (larger steps measured slower per token there) even where
    max_model_len is 8,192 (other devices then take 8,192); an explicit value wins."""
    model = build_checkpoint(str(tmp_path), max_position_embeddings=8192)
    sc = EngineArgs(model=model, device="cpu", max_model_len=8192).create_engine_config().scheduler_config
    assert sc.max_num_batched_tokens == 2048
    sc = EngineArgs(model=model, device="cpu", max_model_len=8192,
                    max_num_batched_tokens=4096).create_engine_config().scheduler_config
    assert sc.max_num_batched_tokens == 4096


def test_threads(monkeypatch):
    assert cpu_threads.resolve_num_threads(3) == (3, "--num-threads")
    with pytest.raises(ValueError, match="num_threads"):
        cpu_threads.resolve_num_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads.resolve_num_threads(None) == (5, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    n, why = cpu_threads.resolve_num_threads(None)
    assert n == cpu_threads.physical_cores() and 1 <= n <= len(cpu_threads._allowed_cpus()) and "physical" in why


_POOL_SCRIPT = """
import os, time, torch
from pagedllm.platforms.cpu.threads import release_openmp_threads
torch.set_num_threads(3)
tids = lambda: set(os.listdir("/proc/self/task"))
x = torch.randn(1 << 20)
release_openmp_threads()
base = tids()                                      # no pool
(x * 2).sum()                                      # a parallel region: this thread's pool of 2 workers
pool = tids() - base
released = release_openmp_threads()
for _ in range(500):                               # a worker leaves /proc a moment after it is told to exit
    if not pool & tids():
        break
    time.sleep(0.01)
print(len(pool), released, len(pool & tids()))
before = tids()
(x * 2).sum()
print(len(tids() - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_release_openmp_threads_frees_the_callers_pool():
    """The server's loader thread gives back its OpenMP workers before the engine thread runs
    the steps (async_engine.AsyncLLM.start); a later parallel region makes a pool again. Threads
    are told apart by id, so another thread of the process that ends meanwhile does not count; the
    workers are given up to 5 s to leave /proc (a CI run saw one still there just after the release)."""
    out = subprocess.run([sys.executable, "-c", _POOL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n")[:2]
    pool, released, left = first.split()
    assert released == "True"
    assert int(pool) == 2 and int(left) == 0, out.stdout
    assert int(second) == 2, out.stdout


def test_async_engine_start_releases_the_loader_threads(llama_dir, monkeypatch):
    from pagedllm.engine import async_engine

    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_threads", lambda: calls.append(1) or True)
    llm = async_engine.AsyncLLM.from_engine_args(EngineArgs(model=llama_dir, device="cpu", max_model_len=64,
                                                            kv_cache_memory=2**20))
    try:
        llm.start()
        llm.start()  # already running: nothing more
        assert calls == [1]
    finally:
        llm.shutdown()


def test_engine_uses_fixed_kv_space_and_logs_choices(llama_dir, monkeypatch):
    from conftest import pagedllm_logs
    space_gib = 0.001
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", str(space_gib))
    prev = torch.get_num_threads()
    try:
        with pagedllm_logs() as records:  # not caplog: its handling of non-propagating loggers changed in pytest 9.2
            llm = LLM(llama_dir, device="cpu", num_threads=1, max_model_len=128)
        engine = llm.llm_engine
        assert torch.get_num_threads() == 1
        per_block = engine.executor.bytes_per_block()
        assert engine.config.cache_config.num_blocks == int(space_gib * 2**30) // per_block
        line = next(r.getMessage() for r in records if "KV cache:" in r.getMessage())
        assert "PAGEDLLM_CPU_KVCACHE_SPACE=0.001 GiB" in line and "threads 1 (--num-threads)" in line
        assert "dtype=float32 (auto: PAGEDLLM_CPU_AUTO_DTYPE=float32)" in line
        out = llm.generate(["the king"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4
        assert_pool_empty(llm)
    finally:
        torch.set_num_threads(prev)


_SPIN_SCRIPT = "import os, pagedllm, torch; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize("env, want", [({}, "1000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                       ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")])
def test_openmp_spin_count_default_leaves_the_users_setting(env, want):
    """Importing pagedllm (before torch loads libgomp) sets libgomp's barrier spin count to 1,000
    where the user set neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY."""
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _SPIN_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**base, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [want]
