"""Data parallelism: N engine replicas (separate processes, ``engine/dp_replica.py``) behind one
``AsyncLLM`` interface, so the API server runs unchanged (as vLLM's ``--data-parallel-size``).

Each replica holds a full model copy, its own KV cache and ``cores / N`` torch threads. The
front end (this process) keeps the tokenizer only; it routes each new request to the replica
with the least outstanding work -- the tokens it still has to process for its unfinished
requests (prompt + remaining max_tokens), ties broken by lower KV-cache usage, then by fewer
requests routed so far (idle replicas take turns), then index --
and forwards aborts to the replica that holds the request (which frees its blocks before its
next step). One reader thread per replica delivers outputs to the callers' streams.

Failure is loud: a replica that dies (EOF on its pipe, a non-zero exit, or a "dead" report)
fails every pending request with EngineDeadError and makes ``check_health()`` False, so the
server answers /health 503 and exits non-zero; ``shutdown()`` stops every replica.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineSnapshot
from pagedllm.engine.dp_replica import replica_main
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.scheduler import SchedulerStats
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend import make_compiler
from pagedllm.worker.multiproc_executor import threads_per_rank

logger = logging.getLogger("pagedllm")

STARTUP_TIMEOUT_S = envs.PAGEDLLM_DP_STARTUP_TIMEOUT_S  # read once, at import


class FrontEngine:
    """What the server reads from ``llm.engine`` without a model: config, tokenizer, prompt and
    sampling-field validation (``tokenize_prompt``, ``verify_logits_fields`` are LLMEngine's; the
    grammar is compiled here to check it, and again in the replica that runs the request) and the
    token-text cache."""

    tokenize_prompt = LLMEngine.tokenize_prompt
    verify_logits_fields = LLMEngine.verify_logits_fields
    check_priority = LLMEngine.check_priority
    bad_words_token_ids = LLMEngine.bad_words_token_ids

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.vocab_size = config.model_config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_compiler = make_compiler(self.tokenizer, self.vocab_size)
        self.pooling = config.model_config.runner == "pooling"  # (as LLMEngine.pooling)


@dataclass
class _Replica:
    index: int
    proc: Any
    conn: Any
    num_blocks: int = 0
    snapshot: Optional[EngineSnapshot] = None
    # request id -> tokens still to process (prompt + remaining max_tokens), for routing
    outstanding: dict[str, int] = field(default_factory=dict)
    max_new: dict[str, int] = field(default_factory=dict)  # request id -> max_tokens x n
    choices: dict[str, int] = field(default_factory=dict)  # request id -> n
    requests_routed: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> tuple[int, float, int, int]:
        # Ties (idle replicas) go to the one routed the fewest requests, so requests that never
        # overlap alternate instead of all landing on replica 0.
        usage = self.snapshot.stats.kv_cache_usage if self.snapshot is not None else 0.0
        return sum(self.outstanding.values()), usage, self.requests_routed, self.index

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)


def _empty_snapshot() -> EngineSnapshot:
    return EngineSnapshot(SchedulerStats(0, 0, 0.0, 0, 0, 0), 0, 0)


def combine_snapshots(snaps: list[EngineSnapshot], num_blocks: list[int]) -> EngineSnapshot:
    """Totals over replicas (KV usage weighted by each replica's block count), with the
    per-replica snapshots in ``replicas``."""
    total_blocks = sum(num_blocks) or 1
    s = [x.stats for x in snaps]
    stats = SchedulerStats(
        num_running=sum(x.num_running for x in s), num_waiting=sum(x.num_waiting for x in s),
        kv_cache_usage=sum(x.kv_cache_usage * b for x, b in zip(s, num_blocks)) / total_blocks,
        num_preemptions=sum(x.num_preemptions for x in s),
        prefix_cache_queries=sum(x.prefix_cache_queries for x in s),
        prefix_cache_hits=sum(x.prefix_cache_hits for x in s))
    return EngineSnapshot(stats, sum(x.prompt_tokens_total for x in snaps),
                          sum(x.generation_tokens_total for x in snaps), replicas=list(snaps))


def replica_threads(data_parallel_size: int, tensor_parallel_size: int = 1) -> int:
    return threads_per_rank(data_parallel_size) if tensor_parallel_size == 1 else \
        max(1, threads_per_rank(data_parallel_size * tensor_parallel_size) * tensor_parallel_size)


def replica_devices(config: EngineConfig, data_parallel_size: int) -> list[Optional[str]]:
    """CUDA_VISIBLE_DEVICES of each replica: its own world-size slice of the visible GPUs (as
    vLLM gives each DP rank its own GPUs); None on a CPU. Raises ValueError when too few GPUs."""
    if not config.device.startswith("cuda"):
        return [None] * data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    world = config.parallel_config.world_size
    if len(ids) < world * data_parallel_size:
        raise ValueError(f"data_parallel_size={data_parallel_size} x {world} GPUs per replica needs "
                         f"{world * data_parallel_size} GPUs, found {len(ids)}")
    return [",".join(ids[i * world:(i + 1) * world]) for i in range(data_parallel_size)]


class DPAsyncLLM(AsyncLLM):
    """``AsyncLLM`` over ``data_parallel_size`` replica processes (same generate / abort /
    snapshot / check_health / shutdown). Raises ValueError when a replica cannot start for a
    configuration reason (its message), RuntimeError when one dies or times out during start-up."""

    def __init__(self, engine_args: EngineArgs, data_parallel_size: int,
                 on_outputs: Optional[Callable[[list[RequestOutput]], None]] = None,
                 on_abort: Optional[Callable[[str], None]] = None, log_level: str = "INFO") -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        config = engine_args.create_engine_config()  # validates the settings before any process starts
        self.replicas: list[_Replica] = []
        self._route: dict[str, _Replica] = {}  # unfinished request id -> its replica
        self._readers: list[threading.Thread] = []
        self._callback_lock = threading.Lock()  # metrics callbacks from several reader threads
        self._closed = False
        front = FrontEngine(config)
        threads = replica_threads(data_parallel_size, config.parallel_config.tensor_parallel_size)
        devices = replica_devices(config, data_parallel_size)
        ctx = mp.get_context("spawn")
        try:
            for i in range(data_parallel_size):
                ours, theirs = ctx.Pipe(duplex=True)
                p = ctx.Process(target=replica_main, name=f"pagedllm-dp-replica{i}", daemon=False,
                                args=(engine_args, i, threads, theirs, os.getpid(), log_level, devices[i]))
                p.start()
                theirs.close()
                self.replicas.append(_Replica(i, p, ours))
            self._wait_ready()
        except BaseException:
            self._stop_replicas()
            raise
        super().__init__(front, on_outputs, on_abort)
        logger.info("data parallel: %d replicas (pids %s), %d threads each", data_parallel_size,
                    [r.proc.pid for r in self.replicas], threads)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, data_parallel_size: int = 2, **kwargs) -> "DPAsyncLLM":
        return cls(args, data_parallel_size, **kwargs)

    # ---- start-up / shut-down --------------------------------------------------------------
    def _wait_ready(self) -> None:
        pending = {r.index: r for r in self.replicas}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            for i, r in list(pending.items()):
                try:
                    msg = r.conn.recv() if r.conn.poll(0.05) else None
                except (EOFError, OSError):
                    msg = ("start_error", f"exited during start-up (exit code {r.proc.exitcode})", False)
                if msg is None and not r.proc.is_alive():
                    r.proc.join(1)
                    msg = ("start_error", f"exited during start-up (exit code {r.proc.exitcode})", False)
                if msg is None:
                    continue
                if msg[0] == "ready":
                    r.num_blocks = msg[1]["num_blocks"]
                    del pending[i]
                elif msg[0] == "start_error":
                    text = f"data-parallel replica {i}: {msg[1]}"
                    raise ValueError(text) if msg[2] else RuntimeError(text)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel replicas {sorted(pending)} did not start within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")

    def start(self) -> "DPAsyncLLM":
        if not self._readers:
            for r in self.replicas:
                t = threading.Thread(target=self._read, args=(r,), daemon=True, name=f"dp-read{r.index}")
                t.start()
                self._readers.append(t)
        return self

    def _stop_replicas(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            if r.proc.is_alive():
                try:
                    r.send(("shutdown",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            r.proc.join(max(0.0, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.terminate()
                r.proc.join(5)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(5)
            r.conn.close()

    def shutdown(self, timeout: float = 30.0, shutdown_engine: bool = True) -> None:
        with self._lock:
            already, self._closed = self._closed, True
            self._stop = True
        if already:
            return
        if not self.errored:
            self._mark_dead("the engine is shutting down", errored=False)
        if shutdown_engine:
            self._stop_replicas(min(timeout, 10.0))

    # ---- requests --------------------------------------------------------------------------
    def _estimate_tokens(self, prompt: PromptType, params: SamplingParams) -> tuple[int, int]:
        """(prompt tokens, most tokens to generate over the n completions)."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            n = len(prompt["prompt_token_ids"])
        elif isinstance(prompt, list):
            n = len(prompt)
        else:
            try:
                n = len(self.engine.tokenize_prompt(prompt)[1])
            except Exception:  # noqa: BLE001 - the replica rejects it with the real message
                n = 1
        max_tokens = params.max_tokens or max(1, self.engine.model_config.max_model_len - n)
        return n, max_tokens * params.n

    def pick_replica(self) -> _Replica:
        """The replica with the least outstanding work (tokens, then KV usage, then requests routed, then index)."""
        return min(self.replicas, key=_Replica.load)

    def _submit(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival: float,
                priority: int = 0) -> None:
        r = self.pick_replica()
        n_prompt, n_new = self._estimate_tokens(prompt, params)
        r.outstanding[request_id] = n_prompt + n_new
        r.max_new[request_id] = n_new
        r.choices[request_id] = params.n
        r.requests_routed += 1
        self._route[request_id] = r
        try:
            r.send(("add", request_id, prompt, params, arrival, priority))
        except (OSError, ValueError) as e:  # the replica is gone; its reader marks the engine dead
            self._forget(request_id)
            raise EngineDeadError(f"data-parallel replica {r.index} is gone: {e}") from None

    def _forget(self, request_id: str) -> Optional[_Replica]:
        r = self._route.pop(request_id, None)
        if r is not None:
            r.outstanding.pop(request_id, None)
            r.max_new.pop(request_id, None)
            r.choices.pop(request_id, None)
        return r

    def abort(self, request_id: str) -> None:
        with self._lock:
            r = self._route.get(request_id)
            n = r.choices.get(request_id, 1) if r is not None else 1
            self._forget(request_id)
        if r is None:
            return
        try:
            r.send(("abort", request_id))
        except (OSError, ValueError):
            return
        self._callback(self.on_abort, request_id, [None] * n)

    def _callback(self, fn: Optional[Callable], *args: Any) -> None:
        if fn is None:
            return
        try:
            with self._callback_lock:
                fn(*args)
        except Exception:  # noqa: BLE001 - metrics must never stop serving
            logger.exception("metrics update failed")

    # ---- replica readers -------------------------------------------------------------------
    def _read(self, r: _Replica) -> None:
        reason = None
        while reason is None:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                if self._stop and not self.errored:
                    return  # we are shutting it down
                r.proc.join(2)
                reason = f"data-parallel replica {r.index} (pid {r.proc.pid}) died (exit code {r.proc.exitcode})"
                break
            kind = msg[0]
            if kind in ("out", "snap"):
                if kind == "out":
                    self._on_outputs(r, msg[1])
                r.snapshot = msg[-1]
                self.snapshot = self._take_snapshot()
            elif kind == "reject":
                with self._lock:
                    self._forget(msg[1])
                self._deliver({msg[1]: ValueError(msg[2])})
            elif kind == "dead":
                reason = f"data-parallel replica {r.index} failed: {msg[1]}"
        logger.error("%s", reason)
        self._mark_dead(reason)

    def _on_outputs(self, r: _Replica, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for o in outputs:
                if o.finished:
                    self._forget(o.request_id)
                elif o.request_id in r.outstanding:  # prefilled: what is left is decoding
                    done = sum(len(c.token_ids) for c in o.outputs)
                    r.outstanding[o.request_id] = max(0, r.max_new[o.request_id] - done)
        if outputs:
            self._callback(self.on_outputs, outputs)
            self._deliver({o.request_id: o for o in outputs})

    # ---- AsyncLLM interface ----------------------------------------------------------------
    def _take_snapshot(self) -> EngineSnapshot:
        snaps = [r.snapshot or _empty_snapshot() for r in self.replicas]
        return combine_snapshots(snaps, [r.num_blocks for r in self.replicas])

    def check_health(self) -> bool:
        if not self.errored and not self._closed:
            dead = [r for r in self.replicas if not r.proc.is_alive()]
            if dead:
                r = dead[0]
                self._mark_dead(f"data-parallel replica {r.index} (pid {r.proc.pid}) died "
                                f"(exit code {r.proc.exitcode})")
        return not self.errored

    def wake(self) -> None:
        pass  # snapshots arrive from the replicas after every step
