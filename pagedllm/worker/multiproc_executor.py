"""Tensor-parallel executor: one process per rank, joined by ``torch.distributed``.

Rank 0 runs in the driver (the process that owns the scheduler, as in vLLM); ranks 1..N-1 are
spawned worker processes. Every rank builds its shard of the model (``layers/linear.py``) and
keeps the KV cache of its own heads. Each call the driver makes (profile, allocate, forward) is
broadcast to the workers over a gloo "control" group as one pickled object
(``distributed/control_channel.py``); every rank runs it, the layers' all-reduce/all-gather run
over the default group (gloo on a CPU, NCCL on CUDA), and rank 0 returns the logits. Replies
(budgets) come back with ``gather_object``. With pipeline parallelism, ``execute_model_async``
sends the batch without waiting and returns after stage 0, so up to ``max_concurrent_batches``
(= pipeline stages) batches are in flight (``worker/pp_runner.py``).

Failure handling: a worker that dies closes its sockets, so the driver's next (or current)
collective raises; the driver also checks ``Process.is_alive()`` before every call. Either way
the executor raises RuntimeError, kills the remaining workers and stays failed. Workers ignore
SIGINT (the driver handles it) and exit when the driver dies (closed sockets, or a watchdog that
polls ``os.getppid()``). ``shutdown()`` (also run at exit and when the executor is collected)
terminates them.

Environment: MASTER_ADDR/MASTER_PORT (torchrun style) set the rendezvous address, else a free
port on 127.0.0.1; PAGEDLLM_TP_TIMEOUT_S bounds each model collective (default 300 s).
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed.control_channel import (PendingBroadcast, broadcast_object, broadcast_object_async,
                                                  recv_broadcast_object)
from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_model_parallel
from pagedllm.models.registry import get_model_class
from pagedllm.worker.executor import Executor, ModelOutputFuture, UniProcExecutor
from pagedllm.worker.model_input import ModelInput
from pagedllm.worker.kv_cache_budget import physical_memory_bytes
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.pp_runner import PPModelRunner, check_pp_support

logger = logging.getLogger("pagedllm")

STARTUP_TIMEOUT_S = 300.0
PING_INTERVAL_S = 2.0  # multi-node: an idle driver checks the other nodes' ranks this often
# The control group waits for the driver's next call, which may be hours away on an idle server;
# a dead peer is still detected at once (closed socket), only a hung-but-alive one is not.
CONTROL_TIMEOUT = timedelta(days=7)


def collective_timeout() -> timedelta:
    return timedelta(seconds=envs.PAGEDLLM_TP_TIMEOUT_S)


def validate_tensor_parallel(hf_config: Any, tp: int) -> None:
    """Raise ValueError when the model cannot be split over ``tp`` ranks (checked in the driver,
    before any process starts; the layers check the same at construction)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads; "
                         f"use a divisor of {heads}")
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {kv_heads} KV heads")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's {kv_heads} KV heads and is not a "
                         f"multiple of it (KV heads are replicated only a whole number of times)")
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP intermediate size {inter}")


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank: the cores shared out (capped by OMP_NUM_THREADS when set)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    n = max(1, cores // world_size)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        n = min(n, int(omp))
    return n


def rendezvous_url() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def to_device(obj: Any, device: Any) -> Any:
    """A copy of ``obj`` (tensors, dataclasses such as ModelInput, lists, tuples) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            setattr(new, f.name, to_device(getattr(obj, f.name), device))
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    return obj


class RankWorker(UniProcExecutor):
    """What every rank runs: joins the process groups, then owns a ModelRunner (its shard). The
    runner calls are UniProcExecutor's; only construction and device placement differ."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
        self.config = config
        self.rank = rank
        on_cuda = config.device.startswith("cuda")
        if on_cuda:  # the local rank on a multi-node launch (every node numbers its GPUs from 0)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if on_cuda else torch.device("cpu")
        pc = config.parallel_config
        assert world_size == pc.world_size, (world_size, pc.world_size)
        init_model_parallel(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                            "nccl" if on_cuda else "gloo", timeout=collective_timeout())
        # Pickled calls travel over gloo on CPU memory even when the model runs on NCCL.
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if pc.pipeline_parallel_size > 1:
            self.runner = PPModelRunner(config)  # this stage's layers (and TP shard)
        else:
            self.runner = ModelRunner(config)  # sharded: the TP state is set above

    def ping(self) -> None:
        """A no-op round trip: proves every rank (on every node) still answers."""

    def execute_model(self, model_input: ModelInput) -> torch.Tensor:
        if self.device.type != "cpu":
            model_input = to_device(model_input, self.device)
        return self.runner.execute_model(model_input)

    def execute_model_async(self, model_input: ModelInput) -> Any:
        """Pipeline parallel only: run this stage and return without waiting for the last
        stage (on the driver, a ``PendingLogits``)."""
        if self.device.type != "cpu":
            model_input = to_device(model_input, self.device)
        return self.runner.execute_model_async(model_input)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, conn: Any,
                parent_pid: int, num_threads: int) -> None:
    """Entry point of a spawned rank: serve the driver's broadcast calls until told to stop."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:  # None: a Ray actor (Ray ties it to its owner instead)
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    torch.set_num_threads(num_threads)
    try:
        conn.send(("ready", None))
        worker = RankWorker(config, rank, world_size, init_method)
        while True:
            method, args = recv_broadcast_object(worker.control)
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != "execute_model":
                dist.gather_object(result, None, dst=0, group=worker.control)
    except BaseException:  # noqa: BLE001 - report, then die: the driver sees the closed sockets
        msg = traceback.format_exc()
        try:
            conn.send(("error", msg))
        except Exception:  # noqa: BLE001 - the driver may be gone
            pass
        sys.stderr.write(f"pagedllm worker rank {rank} failed:\n{msg}")
        sys.stderr.flush()
        os._exit(1)
    try:
        destroy_tensor_parallel()
    finally:
        os._exit(0)


def _shutdown_at_exit(ref: "weakref.ref[MultiprocExecutor]") -> None:
    ex = ref()
    if ex is not None:
        ex.shutdown()


class MultiprocExecutor(Executor):
    """Raises ValueError (before starting any process) when the model cannot be split over
    ``tensor_parallel_size`` ranks, RuntimeError when a worker dies or a collective fails."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = config.parallel_config.tensor_parallel_size
        self.world_size = world = config.parallel_config.world_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._failed: str | None = None
        self._closed = False
        self._owns_group = False
        self._lock = threading.RLock()  # the server checks health from another thread
        self._prev_threads = torch.get_num_threads()
        validate_tensor_parallel(config.model_config.hf_config, tp)
        model_cls = get_model_class(config.model_config.hf_config, config.model_config.max_model_len)
        if tp > 1 and not getattr(model_cls, "supports_tp", True):  # fail before any process starts
            raise ValueError(f"tensor parallelism is not implemented for {model_cls.__name__}; use "
                             f"--tensor-parallel-size 1 (or --pipeline-parallel-size)")
        if config.parallel_config.pipeline_parallel_size > 1:
            check_pp_support(model_cls)
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process (another "
                               "tensor-parallel engine?); shut it down before starting a new one")
        on_cpu = not config.device.startswith("cuda")
        if not on_cpu and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} needs {world} CUDA devices, "
                             f"found {torch.cuda.device_count()}")
        threads = threads_per_rank(world) if on_cpu else self._prev_threads
        pc = config.parallel_config
        # Multi-node: this node (node 0, the driver's) runs ranks 0..L-1; headless nodes run the rest
        # (worker/multinode.py) and join the same rendezvous at master_addr:master_port.
        self.nnodes = pc.nnodes
        self.local_world = world // pc.nnodes
        init_method = f"tcp://{pc.master_addr}:{pc.master_port}" if pc.nnodes > 1 else rendezvous_url()
        self._call_lock = threading.Lock()  # one thread at a time runs collectives (steps, health pings)
        self._last_call = time.monotonic()
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            init_method = self._launch_workers(list(range(1, self.local_world)), init_method, threads)
            self._wait_ready()
            if on_cpu:
                torch.set_num_threads(threads)
            self._owns_group = True
            self.driver = RankWorker(config, 0, world, init_method)
        except BaseException:
            self.shutdown()
            raise
        logger.info("model parallel: %d ranks = tp %d x pp %d (rank 0 in this process, workers %s), %s, "
                    "%d threads per rank", world, tp, config.parallel_config.pipeline_parallel_size,
                    [p.pid for p in self.procs], "gloo" if on_cpu else "nccl", threads)

    # ---- process management ----------------------------------------------------------------
    def _launch_workers(self, ranks: list[int], init_method: str, threads: int) -> str:
        """Start one worker per rank (filling ``procs``/``conns``); returns the rendezvous URL
        (the Ray executor picks its own, reachable from the cluster)."""
        ctx = mp.get_context("spawn")
        for rank in ranks:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                            args=(self.config, rank, self.world_size, init_method, send, os.getpid(), threads))
            p.start()
            send.close()
            self.procs.append(p)
            self.conns.append(recv)
        return init_method

    def _wait_ready(self) -> None:
        pending = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            for rank, conn in list(pending.items()):
                try:
                    msg = conn.recv() if conn.poll(0.05) else None
                except (EOFError, OSError):
                    msg = ("exited", None)
                if msg is not None and msg[0] == "ready":
                    del pending[rank]
                elif msg is not None and msg[0] == "error":
                    raise RuntimeError(f"worker rank {rank} failed to start:\n{msg[1]}")
                elif msg is not None or not self.procs[rank - 1].is_alive():
                    self.procs[rank - 1].join(timeout=5)
                    raise RuntimeError(
                        f"worker rank {rank} exited during start-up (exit code "
                        f"{self.procs[rank - 1].exitcode}); its error is on stderr. Worker processes are "
                        f"spawned: a script that creates the engine must guard its entry point with "
                        f"`if __name__ == '__main__':`")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker ranks {sorted(pending)} did not start within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")

    def _dead_workers(self) -> list[str]:
        dead = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not p.is_alive():
                detail = ""
                try:
                    while conn.poll(0):
                        kind, msg = conn.recv()
                        if kind == "error":
                            detail = f":\n{msg}"
                except (EOFError, OSError):
                    pass
                dead.append(f"rank {rank} (pid {p.pid}, exit code {p.exitcode}){detail}")
        return dead

    def _fail(self, cause: BaseException | None) -> RuntimeError:
        """Record the failure, stop every worker, and return the error to raise."""
        with self._lock:
            if self._failed is not None:
                return RuntimeError(self._failed)
            return self._fail_locked(cause)

    def _fail_locked(self, cause: BaseException | None) -> RuntimeError:
        dead = self._dead_workers()
        if not dead and cause is not None:
            # A collective can fail a moment before the peer's exit is visible to waitpid.
            deadline = time.monotonic() + 2.0
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self._dead_workers()
        if dead:
            msg = "tensor-parallel worker died: " + "; ".join(dead)
        else:
            msg = f"tensor-parallel collective failed: {type(cause).__name__}: {cause}"
        self._failed = msg
        self._kill_workers()
        return RuntimeError(msg)

    def _check_local(self) -> None:
        if self._failed is not None:
            raise RuntimeError(self._failed)
        if self._closed:
            raise RuntimeError("the tensor-parallel executor was shut down")
        if any(not p.is_alive() for p in self.procs):
            raise self._fail(None)

    def check_health(self) -> None:
        self._check_local()
        if self.nnodes > 1 and time.monotonic() - self._last_call > PING_INTERVAL_S:
            # Ranks on other nodes are not our children: a round trip shows whether they still answer
            # (a dead node's closed sockets fail it at once). Skipped while a step holds the lock.
            if self._call_lock.acquire(blocking=False):
                try:
                    self._call_locked("ping")
                finally:
                    self._call_lock.release()

    def _call(self, method: str, *args: Any) -> Any:
        """Run ``method`` on every rank; returns rank 0's result for execute_model, else the list
        of every rank's result."""
        with self._call_lock:
            return self._call_locked(method, *args)

    def _call_locked(self, method: str, *args: Any) -> Any:
        self._last_call = time.monotonic()
        self._check_local()
        try:
            wire_args = args if self.driver.device.type == "cpu" else to_device(args, "cpu")
            broadcast_object((method, wire_args), self.driver.control)
            result = getattr(self.driver, method)(*args)
            if method == "execute_model":
                return result
            results: list[Any] = [None] * self.world_size
            dist.gather_object(result, results, dst=0, group=self.driver.control)
            self._last_call = time.monotonic()
            return results
        except BaseException as e:
            raise self._failure(e)

    def _failure(self, e: BaseException) -> BaseException:
        """What to raise after ``e`` interrupted a call: the executor is failed either way (the ranks
        are out of step); a communication error becomes RuntimeError, anything else (Ctrl-C, a bug in
        rank 0) is raised as is."""
        if isinstance(e, (RuntimeError, OSError)):
            err = self._fail(e)
            err.__cause__ = e
            return err
        self._fail(None)
        return e

    def _stop_remote_ranks(self, timeout_s: float = 5.0) -> None:
        """Tell every rank to exit cleanly (ranks on other nodes are not ours to kill); bounded, so a
        hung peer cannot hold up the shutdown."""
        def tell():
            try:
                broadcast_object(("shutdown", ()), self.driver.control)
            except Exception:  # noqa: BLE001 - peers already gone: nothing to tell
                pass

        if self._call_lock.acquire(timeout=timeout_s):
            try:
                t = threading.Thread(target=tell, daemon=True, name="pagedllm-stop-ranks")
                t.start()
                t.join(timeout_s)
            finally:
                self._call_lock.release()

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def shutdown(self) -> None:
        """Stop every worker process and leave the process group (idempotent)."""
        with self._lock:
            if self._closed:
                return
            if self.nnodes > 1 and self._failed is None and self._owns_group:
                self._stop_remote_ranks()
            self._closed = True
            try:
                self._kill_workers()
                for conn in self.conns:
                    conn.close()
            finally:
                if self._owns_group:
                    try:
                        destroy_tensor_parallel()
                    except Exception:  # noqa: BLE001 - peers are gone; nothing left to tear down cleanly
                        pass
                torch.set_num_threads(self._prev_threads)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- Executor interface -------------------------------------------------------------
    def determine_kv_budget(self) -> tuple[int, str]:
        results = self._call("determine_kv_budget")
        budgets = [b for b, _ in results]
        cc = self.config.cache_config
        if self.config.device == "cpu" and cc.kv_cache_memory is None and cc.cpu_kv_cache_space is None:
            # All ranks share this host's RAM: each computed (limit - own RSS); split what is left.
            limit = int(physical_memory_bytes() * cc.gpu_memory_utilization)
            used = sum(limit - b for b in budgets)
            return (limit - used) // self.world_size, (
                f"({cc.gpu_memory_utilization:.2f} x {physical_memory_bytes() / 2**30:.1f} GiB RAM - "
                f"{used / 2**30:.2f} GiB in use by {self.world_size} ranks) / {self.world_size} ranks")
        i = min(range(self.world_size), key=lambda r: budgets[r])
        return budgets[i], f"{results[i][1]} (rank {i}, the smallest of {self.world_size} ranks)"

    def bytes_per_block(self) -> int:
        if self.config.parallel_config.pipeline_parallel_size == 1:
            return self.driver.bytes_per_block()  # every rank holds the same number of KV heads
        return max(self._call("bytes_per_block"))  # stages may own different numbers of layers

    def weight_bytes(self) -> int:
        return self.driver.weight_bytes()  # per rank (rank 0)

    def sliding_windows(self) -> list[Optional[int]]:
        if self.config.parallel_config.pipeline_parallel_size == 1:
            return self.driver.sliding_windows()  # every rank holds every layer
        return [w for stage in self._call("sliding_windows") for w in stage]  # (TP ranks repeat their stage's)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def execute_model(self, model_input: ModelInput) -> torch.Tensor:
        return self._call("execute_model", model_input)

    @property
    def max_concurrent_batches(self) -> int:
        """One batch in flight per pipeline stage (as vLLM); 1 without pipeline parallelism."""
        return self.config.parallel_config.pipeline_parallel_size

    def execute_model_async(self, model_input: ModelInput) -> ModelOutputFuture:
        """Send the batch to every rank and run stage 0 here; returns once stage 0 has handed its
        hidden states on, before the logits are back (pipeline parallelism only; otherwise the
        synchronous call). Raises RuntimeError (now or from ``result()``) when a rank died."""
        if self.max_concurrent_batches == 1:
            return super().execute_model_async(model_input)
        with self._call_lock:
            self._last_call = time.monotonic()
            self._check_local()
            try:
                wire = model_input if self.driver.device.type == "cpu" else to_device(model_input, "cpu")
                sent = broadcast_object_async(("execute_model", (wire,)), self.driver.control)
                pending = self.driver.execute_model_async(model_input)
            except BaseException as e:
                raise self._failure(e)
        return _PipelinedOutput(self, sent, pending)


class _PipelinedOutput(ModelOutputFuture):
    """The logits of a batch in flight: stage 0 is done, the last stage sends them to the driver
    (a posted ``irecv``); ``result()`` waits for them and for every rank to have had the call."""

    def __init__(self, executor: MultiprocExecutor, sent: PendingBroadcast, pending: Any) -> None:
        self._executor, self._sent, self._pending = executor, sent, pending

    def done(self) -> bool:
        return self._pending.done()

    def result(self) -> torch.Tensor:
        ex = self._executor
        if ex._failed is not None:
            raise RuntimeError(ex._failed)
        try:
            logits = self._pending.wait()
            self._sent.wait()
            return logits
        except BaseException as e:
            raise ex._failure(e)
