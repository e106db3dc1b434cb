"""The API server's side of the engine core processes (``engine/core.py``): an ``AsyncLLM``
(same generate / abort / abort_all / snapshot / check_health / shutdown) whose engine runs
elsewhere, so HTTP, tokenization, detokenization and streaming in this process no longer share a
GIL with scheduling and the model (vLLM V1's ``AsyncLLM`` + ``EngineCoreClient``).

One core is the default of ``pagedllm serve``; ``data_parallel_size`` N > 1 starts N cores, each a
full model copy with its own KV cache and ``cores / N`` threads (vLLM's ``--data-parallel-size``):
a new request goes to the core with the least outstanding work -- the tokens it still has to
process for its unfinished requests (prompt + remaining max_tokens), ties broken by lower KV-cache
usage, then by fewer requests routed so far (idle cores take turns), then index.

Transport: ZeroMQ over ipc sockets in a private temporary directory; this process binds one PUSH
socket per core (``AddRequest``, ``AbortRequests``, ``StopSequences``, ``WatchPool``, ``Shutdown``)
and one PULL socket all cores push to (``StepOutputs`` and the rest); msgspec Structs
(``engine/core_protocol.py``). One reader thread here turns each core's token-id deltas into
cumulative ``RequestOutput``s (incremental detokenization and stop strings: ``OutputProcessor`` over
``_Mirror`` samples), tells the core which samples a stop string ended, and hands the outputs to the
callers' event loops. A running one-sample request whose caller has not taken its last output yet
gets ``LAZY_OUTPUT`` instead: the caller builds the newest output when it reads (``_lazy_output``), so
a caller that lags a few steps costs one output build per read, not one per step.

Failure is loud: a core that dies (its process sentinel fires, or it reports ``Dead``) fails every
pending request with EngineDeadError and makes ``check_health()`` False, so the server answers
/health 503 and exits non-zero; ``shutdown()`` stops every core (a core also exits by itself when
this process goes away).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import zmq

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.engine import core_protocol as P
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import LAZY_OUTPUT, AsyncLLM, EngineDeadError, EngineSnapshot
from pagedllm.engine.core import core_main
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import RequestStatus
from pagedllm.engine.scheduler import SchedulerStats
from pagedllm.engine.speculator import SpecDecodeStats
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.multimodal.processor import make_mm_processor
from pagedllm.outputs import Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend import make_compiler
from pagedllm.worker.multiproc_executor import threads_per_rank

logger = logging.getLogger("pagedllm")

STARTUP_TIMEOUT_S = envs.PAGEDLLM_DP_STARTUP_TIMEOUT_S  # read once, at import

_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH_CAPPED,
           "abort": RequestStatus.FINISHED_ABORTED}


class FrontEngine:
    """What the server reads from ``llm.engine`` without a model: config, tokenizer, prompt and
    sampling-field validation (``tokenize_prompt``, ``verify_logits_fields`` are LLMEngine's; the
    grammar is compiled here to check it, and again in the core that runs the request) and the
    output processor (detokenization, stop strings, the token-text cache)."""

    tokenize_prompt = LLMEngine.tokenize_prompt
    preprocess_prompt = LLMEngine.preprocess_prompt
    verify_logits_fields = LLMEngine.verify_logits_fields
    check_priority = LLMEngine.check_priority
    bad_words_token_ids = LLMEngine.bad_words_token_ids

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.vocab_size = config.model_config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler_config.stream_interval)
        self.grammar_compiler = make_compiler(self.tokenizer, self.vocab_size)
        self.pooling = config.model_config.runner == "pooling"  # (as LLMEngine.pooling)
        self.mm_processor = make_mm_processor(config)  # images are processed here, encoded in the core


class _Mirror:
    """This process's copy of one sample: what ``OutputProcessor`` reads of a ``Request``, filled
    from the core's deltas."""

    __slots__ = ("request_id", "parent_id", "index", "sampling_params", "output_token_ids", "status",
                 "stop_reason", "cumulative_logprob", "logprobs", "metrics", "prompt_logprobs",
                 "num_cached_tokens", "pooled")

    def __init__(self, request_id: str, parent_id: str, index: int, params: SamplingParams,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.parent_id = parent_id
        self.index = index
        self.sampling_params = params
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: Any = None
        self.cumulative_logprob = 0.0
        self.logprobs: list = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: list = []
        self.num_cached_tokens = 0
        self.pooled: Optional[torch.Tensor] = None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def token_ids(self) -> list[int]:  # (as CompletionOutput's, for _Progress readers)
        return self.output_token_ids


class _Progress:
    """What ``on_outputs`` (the server's metrics) reads of a running one-sample request's output
    (request_id, metrics, outputs[i].token_ids, finished), for a step whose output is built later by
    its caller (``CoreClient._lazy_output``)."""

    __slots__ = ("request_id", "metrics", "outputs")
    finished = False

    def __init__(self, request_id: str, metrics: RequestMetrics, outputs: tuple) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.outputs = outputs


def _position(rows: Optional[list]) -> Optional[dict[int, Logprob]]:
    return None if rows is None else {tid: Logprob(lp, rank, text) for tid, lp, rank, text in rows}


@dataclass
class _Replica:
    """One engine core process, as this process sees it."""
    index: int
    proc: Any
    conn: Any  # our PUSH socket to it
    num_blocks: int = 0
    snapshot: Optional[EngineSnapshot] = None
    # request id -> tokens still to process (prompt + remaining max_tokens), for routing
    outstanding: dict[str, int] = field(default_factory=dict)
    max_new: dict[str, int] = field(default_factory=dict)  # request id -> max_tokens x n
    choices: dict[str, int] = field(default_factory=dict)  # request id -> n
    requests_routed: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    encoder: Any = None

    def load(self) -> tuple[int, float, int, int]:
        # Ties (idle cores) go to the one routed the fewest requests, so requests that never
        # overlap alternate instead of all landing on core 0.
        usage = self.snapshot.stats.kv_cache_usage if self.snapshot is not None else 0.0
        return sum(self.outstanding.values()), usage, self.requests_routed, self.index

    def send(self, msg: Any) -> None:
        """Raises EngineDeadError when the socket is closed (we are shutting down)."""
        with self.send_lock:
            try:
                self.conn.send(self.encoder.encode(msg), copy=False)
            except zmq.ZMQError as e:
                raise EngineDeadError(f"engine core {self.index} is gone: {e}") from None


def _empty_snapshot() -> EngineSnapshot:
    return EngineSnapshot(SchedulerStats(0, 0, 0.0, 0, 0, 0), 0, 0)


def _snapshot(s: P.CoreSnapshot) -> EngineSnapshot:
    return EngineSnapshot(SchedulerStats(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_preemptions,
                                         s.prefix_cache_queries, s.prefix_cache_hits, *s.mm_cache),
                          s.prompt_tokens_total, s.generation_tokens_total, s.num_blocks, s.num_free_blocks,
                          s.num_cached_free_blocks,
                          spec_decode=SpecDecodeStats(*s.spec_decode[:3], list(s.spec_decode[3]))
                          if s.spec_decode is not None else None)


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
        prefix_cache_hits=sum(x.prefix_cache_hits for x in s),
        mm_cache_queries=sum(x.mm_cache_queries for x in s), mm_cache_hits=sum(x.mm_cache_hits for x in s))
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
    if data_parallel_size == 1 and not visible:
        return [None]  # one core sees what this process sees
    return [",".join(ids[i * world:(i + 1) * world]) for i in range(data_parallel_size)]


class CoreClient(AsyncLLM):
    """``AsyncLLM`` over ``num_cores`` engine core processes. Raises ValueError when a core cannot
    start for a configuration reason (its message), RuntimeError when one dies or times out during
    start-up."""

    def __init__(self, engine_args: EngineArgs, num_cores: int = 1,
                 on_outputs: Optional[Callable[[list[RequestOutput]], None]] = None,
                 on_abort: Optional[Callable[[str, list[Optional[str]]], None]] = None,
                 log_level: str = "INFO") -> None:
        if num_cores < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_cores}")
        config = engine_args.create_engine_config()  # validates the settings before any process starts
        self.replicas: list[_Replica] = []
        self._route: dict[str, _Replica] = {}  # unfinished request id -> its core
        self._reader: Optional[threading.Thread] = None
        self._closed = False
        self._on_pool: Optional[Callable] = None
        # Requests whose last delivered output their caller has not taken yet: False (a built output),
        # True (LAZY_OUTPUT). The reader adds (under _lock); the caller pops (_taken, atomic).
        self._unread: dict[str, bool] = {}
        front = FrontEngine(config)
        threads = replica_threads(num_cores, config.parallel_config.tensor_parallel_size)
        devices = replica_devices(config, num_cores)
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        self._ctx = zmq.Context(io_threads=1)
        self._encoder, self._decoder = P.front_codec()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        ctx = mp.get_context("spawn")
        try:
            for i in range(num_cores):
                push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                addr = f"ipc://{self._dir}/in{i}"
                push.bind(addr)
                p = ctx.Process(target=core_main, name=f"pagedllm-engine-core{i}", daemon=False,
                                args=(engine_args, i, threads, addr, f"ipc://{self._dir}/out", os.getpid(),
                                      log_level, devices[i]))
                p.start()
                self.replicas.append(_Replica(i, p, push, encoder=self._encoder))
            self._wait_ready(front.config)
        except BaseException:
            self._stop_replicas()
            self._close_sockets()
            raise
        super().__init__(front, on_outputs, on_abort)
        logger.info("engine core: %s (pid%s %s), %d threads each; the API server process tokenizes, "
                    "detokenizes and streams (ZeroMQ + msgspec between them)",
                    "its own process" if num_cores == 1 else f"{num_cores} data-parallel processes",
                    "" if num_cores == 1 else "s", ", ".join(str(r.proc.pid) for r in self.replicas), threads)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, data_parallel_size: int = 1, **kwargs) -> "CoreClient":
        return cls(args, data_parallel_size, **kwargs)

    # ---- start-up / shut-down --------------------------------------------------------------
    def _wait_ready(self, config: EngineConfig) -> None:
        pending = {r.index: r for r in self.replicas}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            msg = self._decoder.decode(self._out.recv()) if self._out.poll(50) else None
            if msg is None:
                for i, r in pending.items():
                    if not r.proc.is_alive():
                        r.proc.join(1)
                        if self._out.poll(500):  # its StartError may still be on the way: read that first
                            break
                        raise RuntimeError(f"{self._name(i)}: exited during start-up (exit code {r.proc.exitcode})")
            elif isinstance(msg, P.Ready):
                r = pending.pop(msg.core)
                r.num_blocks = msg.num_blocks
                # The front end's copy of the config shows what the core settled (dashboard facts).
                config.cache_config.num_blocks = msg.num_blocks
                config.cache_config.sliding_window = msg.sliding_window
            elif isinstance(msg, P.StartError):
                text = f"{self._name(msg.core)}: {msg.message}" if len(self.replicas) > 1 else msg.message
                raise ValueError(text) if msg.is_value_error else RuntimeError(text)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"engine cores {sorted(pending)} did not start within {STARTUP_TIMEOUT_S:.0f} s")
        if len(self.replicas) > 1:
            config.cache_config.num_blocks = sum(r.num_blocks for r in self.replicas)

    def start(self) -> "CoreClient":
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True, name="pagedllm-core-read")
            self._reader.start()
        return self

    def _stop_replicas(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            if r.proc.is_alive():
                try:
                    r.send(P.Shutdown())
                except EngineDeadError:
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

    def _close_sockets(self) -> None:
        for r in self.replicas:
            with r.send_lock:
                r.conn.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

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
            if self._reader is not None:
                self._reader.join(5)
            if self._reader is None or not self._reader.is_alive():
                self._close_sockets()

    # ---- requests --------------------------------------------------------------------------
    def pick_replica(self) -> _Replica:
        """The core with the least outstanding work (tokens, then KV usage, then requests routed, then index)."""
        return min(self.replicas, key=_Replica.load)

    def _submit(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival: float,
                priority: int = 0) -> None:
        """Called with ``_lock`` held. Raises ValueError for a prompt that does not tokenize."""
        text, ids, mm = self.engine.preprocess_prompt(prompt)
        r = self.pick_replica() if len(self.replicas) > 1 else self.replicas[0]
        max_tokens = params.max_tokens or max(1, self.engine.model_config.max_model_len - len(ids))
        r.outstanding[request_id] = len(ids) + max_tokens * params.n
        r.max_new[request_id] = max_tokens * params.n
        r.choices[request_id] = params.n
        r.requests_routed += 1
        self._route[request_id] = r
        mirrors = [_Mirror(request_id if params.n == 1 else f"{request_id}#{i}", request_id, i, params, arrival)
                   for i in range(params.n)]
        self.engine.output_processor.add_request(request_id, text, ids, mirrors)
        try:
            r.send(P.AddRequest(request_id, ids, params, arrival, priority, self._loras.pop(request_id, None), mm))
        except EngineDeadError:
            self._forget(request_id)
            raise

    def register_lora(self, lora_request) -> None:
        """Serve an adapter the front end has checked (every core records it)."""
        for r in self.replicas:
            r.send(P.LoRAUpdate(add=lora_request))

    def unregister_lora(self, lora_int_id: int) -> None:
        for r in self.replicas:
            r.send(P.LoRAUpdate(remove_id=lora_int_id))

    def _forget(self, request_id: str) -> Optional[_Replica]:
        self.engine.output_processor.drop(request_id)
        self._unread.pop(request_id, None)
        r = self._route.pop(request_id, None)
        if r is not None:
            r.outstanding.pop(request_id, None)
            r.max_new.pop(request_id, None)
            r.choices.pop(request_id, None)
        return r

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread); the core frees its KV blocks before its next step."""
        with self._lock:
            state = self.engine.output_processor.states.get(request_id)
            reasons = [m.status.finish_reason for m in state.children] if state is not None else None
            r = self._forget(request_id)
        if r is None:
            return
        try:
            r.send(P.AbortRequests([request_id]))
        except EngineDeadError:
            return
        self._callback(self.on_abort, request_id, reasons or [None])

    def abort_all(self) -> int:
        """End every request in flight: each caller gets a final output with finish_reason "abort"
        (as ``AsyncLLM.abort_all``), and one log line for all of them."""
        finals: dict[str, RequestOutput] = {}
        by_core: dict[int, list[str]] = {}
        with self._lock:
            op = self.engine.output_processor
            for rid in list(self._route):
                state = op.states.get(rid)
                if state is None:
                    continue
                for m in state.children:
                    if not m.is_finished:
                        m.status = RequestStatus.FINISHED_ABORTED
                out = op.make_output(rid)
                if out is not None:
                    finals[rid] = out
                by_core.setdefault(self._forget(rid).index, []).append(rid)
        for i, ids in by_core.items():
            try:
                self.replicas[i].send(P.AbortRequests(ids))
            except EngineDeadError:
                pass
        for rid, out in finals.items():
            self._callback(self.on_abort, rid, [c.finish_reason for c in out.outputs])
        if finals:
            at_exit = [f"{rid} ({sum(len(c.token_ids) for c in o.outputs)} generated tokens)" for rid, o in finals.items()]
            logger.warning("aborted %d request(s) at shutdown: %s%s", len(at_exit), ", ".join(at_exit[:8]),
                           f" and {len(at_exit) - 8} more" if len(at_exit) > 8 else "")
            self._deliver(finals)
        return len(finals)

    def _callback(self, fn: Optional[Callable], *args: Any) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - metrics must never stop serving
            logger.exception("metrics update failed")

    # ---- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        sentinels = {r.proc.sentinel: r for r in self.replicas}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        reason = None
        while reason is None:
            try:
                events = dict(poller.poll())
            except zmq.ZMQError:
                return  # the context was closed: shutting down
            if self._out in events:
                while reason is None:
                    try:
                        frame = self._out.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    reason = self._on_message(self._decoder.decode(frame.buffer))
            for fd, r in sentinels.items():
                if fd in events and reason is None:
                    if self._stop and not self.errored:
                        return  # we are shutting it down
                    while self._out.poll(0):  # its last words (a Dead report) first
                        reason = self._on_message(self._decoder.decode(self._out.recv()))
                        if reason is not None:
                            break
                    if reason is None:
                        r.proc.join(2)
                        reason = f"{self._name(r.index)} (pid {r.proc.pid}) died (exit code {r.proc.exitcode})"
        logger.error("%s", reason)
        self._mark_dead(reason)

    def _name(self, index: int) -> str:
        return "the engine core" if len(self.replicas) == 1 else f"data-parallel replica {index}"

    def _on_message(self, msg: Any) -> Optional[str]:
        """Handle one core message; a reason to mark the engine dead, else None."""
        if isinstance(msg, P.StepOutputs):
            r = self.replicas[msg.core]
            if msg.outputs:
                self._on_outputs(r, msg.outputs)
            r.snapshot = _snapshot(msg.snapshot)
            self.snapshot = self._take_snapshot()
        elif isinstance(msg, P.Rejected):
            with self._lock:
                self._forget(msg.request_id)
            self._deliver({msg.request_id: ValueError(msg.message)})
        elif isinstance(msg, P.PoolSample):
            if self._on_pool is not None:
                self._callback(self._on_pool, msg.version, msg.time, msg.num_blocks, msg.running, msg.waiting,
                               msg.cached_free, msg.num_running, msg.num_waiting, msg.kv_cache_usage,
                               msg.num_cached_free_blocks)
        elif isinstance(msg, P.Dead):
            return f"{self._name(msg.core)} failed: {msg.reason}"
        return None

    def _on_outputs(self, r: _Replica, deltas: list[P.RequestDelta]) -> None:
        """Apply one step's deltas: detokenize, match stop strings, build the outputs (reader thread)."""
        outputs: list[RequestOutput] = []
        lazy: list[str] = []  # running requests whose caller builds its output when it reads it
        stopped: list[str] = []
        op = self.engine.output_processor
        states = op.states
        streams = self._streams
        unread = self._unread
        with self._lock:
            for d in deltas:
                state = states.get(d.request_id)
                if state is None:
                    continue  # aborted here, or ended by a stop string a step ago
                children = state.children
                updated = []
                for sd in d.seqs:
                    m = children[sd.index]
                    if m.status.finished:
                        continue  # a stop string ended it here; the core has been told
                    m.output_token_ids += sd.new_token_ids
                    if sd.new_logprobs is not None:
                        m.logprobs += [_position(p) for p in sd.new_logprobs]
                        m.cumulative_logprob = sd.cumulative_logprob
                    if sd.finish_reason is not None:
                        m.status = _STATUS[sd.finish_reason]
                        m.stop_reason = sd.stop_reason
                    elif m.status is RequestStatus.WAITING:
                        m.status = RequestStatus.RUNNING
                    mt = m.metrics
                    mt.first_scheduled_time, mt.first_token_time = sd.first_scheduled_time, sd.first_token_time
                    mt.last_token_time, mt.finished_time = sd.last_token_time, sd.finished_time
                    updated.append(m)
                first = children[0]
                first.num_cached_tokens = d.num_cached_tokens
                if d.prompt_logprobs is not None:
                    first.prompt_logprobs = [_position(p) for p in d.prompt_logprobs]
                if d.pooled is not None:
                    first.pooled = torch.frombuffer(bytearray(d.pooled), dtype=torch.float32)
                for sid in op.process(updated):  # samples a stop string ended
                    m = children[int(sid.rsplit("#", 1)[1]) if "#" in sid else 0]
                    m.status = RequestStatus.FINISHED_STOPPED
                    m.metrics.finished_time = time.time()
                    stopped.append(sid)
                if not op.output_due(d.request_id):
                    continue  # --stream-interval: its tokens wait for the next output
                rid = d.request_id
                was_lazy = unread.get(rid)  # (one read: the caller pops it from its own thread)
                if was_lazy is not None and len(children) == 1 and not children[0].status.finished:
                    # Running, one sample, and its caller has not taken the last output yet (it lags):
                    # it builds the newest when it reads it (_lazy_output), once for all the steps
                    # since; the metrics still see every step.
                    m = children[0]
                    if not was_lazy:
                        unread[rid] = True
                        lazy.append(rid)
                    outputs.append(_Progress(rid, m.metrics, (m,)))
                    if rid in r.outstanding:
                        r.outstanding[rid] = max(0, r.max_new[rid] - len(m.output_token_ids))
                    continue
                out = op.make_output(d.request_id)
                if out is None:
                    continue
                outputs.append(out)
                if rid in streams:
                    unread[rid] = False
                if out.finished:
                    self._forget(d.request_id)
                elif d.request_id in r.outstanding:  # prefilled: what is left is decoding
                    done = sum(len(c.token_ids) for c in out.outputs)
                    r.outstanding[d.request_id] = max(0, r.max_new[d.request_id] - done)
        if stopped:
            try:
                r.send(P.StopSequences(stopped))
            except EngineDeadError:
                pass
        if outputs:
            self._callback(self.on_outputs, outputs)  # (metrics: _Progress stands in for a lazy output)
            items: dict[str, Any] = dict.fromkeys(lazy, LAZY_OUTPUT)
            items.update((o.request_id, o) for o in outputs if o.__class__ is not _Progress)
            self._deliver(items)

    def _lazy_output(self, request_id: str) -> Optional[RequestOutput]:
        """The newest output of a running request delivered ``LAZY_OUTPUT`` (its caller's thread); None
        when it has finished or gone meanwhile (its final output, or error, is delivered by the reader)."""
        with self._lock:
            state = self.engine.output_processor.states.get(request_id)
            if state is None or all(m.status.finished for m in state.children):
                return None
            return self.engine.output_processor.make_output(request_id)

    def _taken(self, request_id: str) -> None:
        self._unread.pop(request_id, None)

    # ---- AsyncLLM interface ----------------------------------------------------------------
    def _take_snapshot(self) -> EngineSnapshot:
        if len(self.replicas) == 1:
            return self.replicas[0].snapshot or _empty_snapshot()
        snaps = [r.snapshot or _empty_snapshot() for r in self.replicas]
        return combine_snapshots(snaps, [r.num_blocks for r in self.replicas])

    def watch_pool(self, on_pool: Callable, interval_s: float) -> None:
        """Have core 0 ship a block-pool sample at most every ``interval_s`` (and once idle);
        ``on_pool(version, time, num_blocks, running, waiting, cached_free, num_running,
        num_waiting, kv_cache_usage, num_cached_free_blocks)`` gets each, on the reader thread."""
        self._on_pool = on_pool
        self.replicas[0].send(P.WatchPool(interval_s))

    def check_health(self) -> bool:
        if not self.errored and not self._closed:
            dead = [r for r in self.replicas if not r.proc.is_alive()]
            if dead:
                r = dead[0]
                self._mark_dead(f"{self._name(r.index)} (pid {r.proc.pid}) died (exit code {r.proc.exitcode})")
        return not self.errored

    def wake(self) -> None:
        pass  # snapshots arrive from the cores after every step
